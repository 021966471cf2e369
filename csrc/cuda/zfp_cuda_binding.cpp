// CUDA implementations of the ZFP ops: argument checks, then the launchers of zfp_kernels.cu on the
// current stream (no host sync, no host copy).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "zpp/zfp_checks.h"
#include "zpp/zfp_cuda_launchers.h"

namespace zpp {
namespace {

cuda::FloatType float_type(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return cuda::FloatType::kFloat32;
    case at::kBFloat16: return cuda::FloatType::kBFloat16;
    default: return cuda::FloatType::kFloat16;  // check_float() ran first
  }
}

void check_word_aligned(const at::Tensor& payload) {
  // The kernels read and write the stream as 64-bit words (payload sizes are whole words, so
  // payloads packed back to back in an aligned buffer stay aligned).
  TORCH_CHECK(reinterpret_cast<uintptr_t>(payload.data_ptr()) % 8 == 0,
              "megatron_zpp: a zfp payload on the GPU must start on an 8-byte boundary");
}

void zfp_encode_cuda(const at::Tensor& x, const at::Tensor& payload, int64_t dims, int64_t maxbits) {
  check_zfp_encode(x, payload, dims, maxbits);
  if (x.numel() == 0) return;
  check_word_aligned(payload);
  const c10::cuda::CUDAGuard guard(x.device());
  cuda::launch_zfp_encode(x.data_ptr(), float_type(x), x.numel(), static_cast<int>(dims), static_cast<int>(maxbits),
                          payload.data_ptr<uint8_t>(), at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void zfp_decode_cuda(const at::Tensor& payload, const at::Tensor& out, int64_t dims, int64_t maxbits) {
  check_zfp_decode(payload, out, dims, maxbits);
  if (out.numel() == 0) return;
  check_word_aligned(payload);
  const c10::cuda::CUDAGuard guard(out.device());
  cuda::launch_zfp_decode(payload.data_ptr<uint8_t>(), out.data_ptr(), float_type(out), out.numel(),
                          static_cast<int>(dims), static_cast<int>(maxbits), at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace zpp

TORCH_LIBRARY_IMPL(megatron_zpp, CUDA, m) {
  m.impl("zfp_encode_", &zpp::zfp_encode_cuda);
  m.impl("zfp_decode_", &zpp::zfp_decode_cuda);
}
