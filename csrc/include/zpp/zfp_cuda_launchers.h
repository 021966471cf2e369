// Plain-C++ entry points of the ZFP CUDA kernels (csrc/cuda/zfp_kernels.cu); no torch headers, as in
// cuda_launchers.h. The torch binding (zfp_cuda_binding.cpp) validates arguments first.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "zpp/cuda_launchers.h"  // FloatType

namespace zpp {
namespace cuda {

// x: numel values of `type`; payload: zfp::payload_bytes(numel, dims, maxbits) bytes, 8-byte aligned.
void launch_zfp_encode(const void* x, FloatType type, int64_t numel, int dims, int maxbits, uint8_t* payload,
                       cudaStream_t stream);

void launch_zfp_decode(const uint8_t* payload, void* out, FloatType type, int64_t numel, int dims, int maxbits,
                       cudaStream_t stream);

}  // namespace cuda
}  // namespace zpp
