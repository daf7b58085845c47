"""Where a training step's time goes (tools.step_profile, `bench_model --profile`): on a
CPU from a real profile; the CUDA path (kernels found through the host operators that
launched them) on stand-in events shaped as torch.profiler makes them."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from tools.bench_model import main
from tools.step_profile import KINDS, OPTIMIZER, kind_of, work_by_name


@pytest.mark.parametrize("name, kind", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "matmul"),
    ("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTN", "matmul"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_nn_align8>", "matmul"),
    ("triton_tem_fused_mm_0", "matmul"),
    ("aten::addmm", "matmul"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<64>>", "attention"),
    ("fmha_cutlassB_bf16_aligned_64x64_k64_sm80", "attention"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", "attention"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>", "optimizer"),
    ("triton_red_fused__log_softmax_0", "other"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "other"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "other"),
    ("Memcpy HtoD (Pageable -> Device)", "other"),
])
def test_kernels_and_operators_are_sorted_by_name(name, kind):
    assert kind_of(name, in_optimizer=False) == kind
    assert kind_of(name, in_optimizer=True) == "optimizer"


def cpu_op(name, parent=None, kernels=()):
    return SimpleNamespace(name=name, device_type=DeviceType.CPU, cpu_parent=parent,
                           kernels=[SimpleNamespace(name=k) for k in kernels])


def kernel(name, us):
    return SimpleNamespace(name=name, device_type=DeviceType.CUDA, device_time_total=us)


def test_on_cuda_kernel_time_is_the_devices_and_the_optimizers_share_comes_from_its_launches():
    """Every kernel the device ran counts, linked to a host operator or not; a kernel
    name's optimizer time is its share of launches from inside the optimizer range (here
    one elementwise kernel of three came from clipping)."""
    optimizer = cpu_op(OPTIMIZER)
    events = [cpu_op("aten::mm", kernels=["gemm_a"]), cpu_op("aten::mul", kernels=["mul_k", "mul_k"]),
              optimizer, cpu_op("aten::_foreach_mul_", optimizer, ["mul_k"]),
              cpu_op("aten::_fused_adamw_", cpu_op("Optimizer.step", optimizer), ["adam_k"]),
              kernel("gemm_a", 600.0), *(kernel("mul_k", 30.0) for _ in range(3)),
              kernel("adam_k", 50.0), kernel("triton_poi_fused_add_0", 20.0)]  # unlinked: still counted
    work = work_by_name(events, cuda=True)
    assert work == {"gemm_a": [1, 600e-6, 0.0], "mul_k": [3, pytest.approx(90e-6), pytest.approx(30e-6)],
                    "adam_k": [1, 50e-6, 50e-6], "triton_poi_fused_add_0": [1, 20e-6, 0.0]}


def test_on_cuda_record_function_ranges_on_the_device_are_no_kernels():
    """With CUDA activity, each record_function range that launched kernels shows on the
    device as well (kineto's gpu_user_annotation, device type CUDA), spanning them: the
    bench's optimizer range, torch.optim's own, torch.compile's regions. Counted, the
    optimizer's kernels would count twice and a compiled forward once more as "other"."""
    def annotation(name, us):
        return SimpleNamespace(name=name, device_type=DeviceType.CUDA, device_time_total=us,
                               is_user_annotation=True)
    events = [cpu_op("aten::_fused_adamw_", cpu_op(OPTIMIZER), ["adam_k"]), kernel("adam_k", 50.0),
              kernel("triton_poi_fused_add_0", 20.0), annotation(OPTIMIZER, 60.0),
              annotation("Optimizer.step#AdamW.step", 55.0), annotation("Torch-Compiled Region: 0/0", 400.0)]
    assert work_by_name(events, cuda=True) == {"adam_k": [1, 50e-6, 50e-6], "triton_poi_fused_add_0": [1, 20e-6, 0.0]}


def test_profiled_cpu_step_splits_into_kinds_that_cover_the_step(tmp_path, capsys):
    """bench_model --profile on a CPU: each mode's training step (not the forward+backward
    rows) says where its time went; the kinds and the idle time cover the step, each kind
    that ran has time, and the matmuls' FLOP/s are the step's matmul FLOPs over their time."""
    main(["--presets", "tiny", "--seq-length", "32", "--batch-size", "2", "--iters", "1", "--warmup", "1",
          "--no-compile", "--device", "cpu", "--profile", "2", "--json", str(tmp_path / "bench.json")])
    out = capsys.readouterr().out
    assert "where a training step's time went (2 profiled steps per mode; operator time on the CPU" in out
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert ["profile" in r for r in rows] == [False, True]  # forward+backward, training step
    prof = rows[1]["profile"]
    assert prof["step_s"] == rows[1]["step_s"] and prof["profiled_steps"] == 2
    assert all(prof["seconds"][k] > 0 for k in KINDS)
    assert prof["busy_s"] == pytest.approx(sum(prof["seconds"].values()))
    assert prof["busy_s"] + prof["idle_s"] >= prof["step_s"]
    assert prof["matmul_flops_per_s"] * prof["seconds"]["matmul"] == pytest.approx(
        (rows[1]["model_flops_per_s"] * rows[1]["step_s"]) - prof["attention_flops_per_s"] * prof["seconds"]["attention"])
    busiest = {b["name"]: b for b in prof["busiest"]}
    assert busiest["aten::mm"]["kind"] == "matmul" and busiest["aten::mm"]["calls_per_step"] > 0
    assert "| tiny   | eager |" in out and "tiny, eager: the busiest, per step" in out
