"""The peak FLOP/s that MFU is measured against, on this machine: a known GPU's datasheet
figure, else a measured one (once, then cached).

The command line of `common.peak_flops`:

    python -m tools.peak               # this machine's peak (measured once, then cached)
    python -m tools.peak --remeasure   # measure again and overwrite the cached value
"""

from __future__ import annotations

import torch

from common.cli import Parser, check_device
from common.environment import device_name, set_tf32
from common.files import read_json
from common.peak_flops import cache_key, cache_path, datasheet_peak, matmul_precision, measured_peak
from common.tables import format_flops


def main(argv=None):
    p = Parser(prog="python -m tools.peak", description=__doc__.split("\n\n")[0])
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
    path = cache_path()
    was_cached = path.is_file() and cache_key(device_name(device), precision, device.type) in (read_json(path) or {})
    measured = measured_peak(device, precision, remeasure=args.remeasure)
    datasheet = datasheet_peak(device_name(device), precision)
    print(f"device: {device_name(device)}; {precision} matmuls; torch {torch.__version__}; "
          f"{torch.get_num_threads()} threads")
    print(f"measured peak: {format_flops(measured)} ({'cached' if was_cached and not args.remeasure else 'measured now'}"
          f" in {path}; other work on the machine lowers it: --remeasure on an idle machine)")
    print("datasheet peak: " + (format_flops(datasheet) if datasheet else "unknown for this device")
          + "; MFU is reported against the " + ("datasheet" if datasheet else "measured")
          + " peak")


if __name__ == "__main__":
    main()
