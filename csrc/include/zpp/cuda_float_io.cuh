// Device-side loads and stores of the three float types the kernels take, through fp32:
// bf16/fp16 are widened exactly and narrowed round-to-nearest-even, as on CPU. Shared by the
// blocked INT8/INT4 kernels and the ZFP kernels.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <stdint.h>

namespace zpp {
namespace cuda {

__device__ __forceinline__ float load_f32(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load_f32(const __nv_bfloat16* p, int64_t i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ float load_f32(const __half* p, int64_t i) { return __half2float(p[i]); }

__device__ __forceinline__ void store_f32(float* p, int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void store_f32(__nv_bfloat16* p, int64_t i, float v) { p[i] = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store_f32(__half* p, int64_t i, float v) { p[i] = __float2half_rn(v); }

}  // namespace cuda
}  // namespace zpp
