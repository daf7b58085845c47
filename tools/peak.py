"""The peak FLOP/s that MFU is measured against, on this machine: a known GPU's datasheet
figure, else a measured one (once, then cached).

The command line of `common.peak_flops`:

    python -m common.peak               # this machine's peak (measured once, then cached)
    python -m common.peak --remeasure   # measure again and overwrite the cached value
"""

from __future__ import annotations

import torch

from .cli import Parser, check_device
from .environment import device_name, set_tf32
from .peak_flops import (busy, cache_path, cached_peak, cached_record, datasheet_peak, matmul_precision,
                         measured_peak)
from .tables import format_flops


def main(argv=None):
    p = Parser(prog="python -m common.peak", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda:N")
    p.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16"),
                   help="the run's dtype; auto: bf16 on CUDA, fp32 on CPU, as the chapters")
    p.add_argument("--remeasure", action="store_true",
                   help="measure even when a cached value exists, and overwrite it")
    p.checks.append(lambda args: check_device(args.device))
    args = p.parse_args(argv)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto"
                          else args.device)
    dtype = ("bf16" if device.type == "cuda" else "fp32") if args.dtype == "auto" else args.dtype
    if device.type == "cuda":
        set_tf32(True)  # as the chapters set it
    precision = matmul_precision(device, dtype)
    before = cached_peak(device, precision)
    measured = measured_peak(device, precision, remeasure=args.remeasure)
    record = cached_record(device, precision)
    datasheet = datasheet_peak(device_name(device), precision)
    print(f"device: {device_name(device)}; {precision} matmuls; torch {torch.__version__}; "
          f"{torch.get_num_threads()} threads")
    load, cores = record.get("load"), record.get("cores")
    when = f"measured {record.get('measured', '?')}"
    if load is not None:
        when += f" at load {load:.1f} on {cores} cores"
    print(f"measured peak: {format_flops(measured)}, the best seen here ({when}; "
          f"{'new' if measured != before else 'cached'} in {cache_path()})")
    if busy(load, cores or 1):
        print("note: the best so far was measured on a busy machine, so it is too low and MFU "
              "too high; it is measured again when the machine is quieter, or run this with "
              "--remeasure on an idle machine")
    print("datasheet peak: " + (format_flops(datasheet) if datasheet else "unknown for this device")
          + "; MFU is reported against the " + ("datasheet" if datasheet else "measured")
          + " peak")


if __name__ == "__main__":
    main()
