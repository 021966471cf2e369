"""The quantize/dequantize kernels launched a few times each, for Nsight Compute on a GPU machine.

    ncu --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \\
        --section LaunchStats -k regex:quantize_rows --launch-skip 1 --launch-count 8 \\
        python3 tools/profile_quant_kernels.py

Launch order: INT8 (block 256) then INT4 (block 128), each an initial quantize and then twice quantize +
dequantize, on 2^25 bf16 values (64 MiB: past the L2 cache). docs/gpu.md has what it showed on an H100.
"""

import torch

from megatron_zpp.compression import ops


def main() -> None:
    x = torch.randn(1 << 25, device="cuda").to(torch.bfloat16)
    for bits, block in ((8, 256), (4, 128)):
        packed = ops.quantize(x, bits, block, backend="kernel")
        out = torch.empty_like(x)
        for _ in range(2):
            ops.quantize_rows_(x, packed, bits, block, backend="kernel")
            ops.dequantize_rows_(packed, out, bits, block, backend="kernel")
    torch.cuda.synchronize()
    print("launched INT8 and INT4 quantize/dequantize on", torch.cuda.get_device_name())


if __name__ == "__main__":
    main()
