// CUDA implementations of the MPC ops and the container checksum: argument checks, buffers,
// then the launchers of mpc_kernels.cu on the current stream. No host sync and no host copy:
// mpc_encode returns the worst-case-sized payload buffer whose header holds the true length
// (reading it would need a sync; base.py's variable-size contract allows the longer buffer).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "zpp/mpc_cuda_launchers.h"
#include "zpp/mpc_math.h"

namespace zpp {
namespace {

void check_float_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf,
              "megatron_zpp::mpc: ", name, " has dtype ", t.scalar_type(), "; valid: float32, bfloat16, float16");
  TORCH_CHECK(t.is_contiguous() && t.is_cuda(), "megatron_zpp::mpc: ", name, " must be a contiguous CUDA tensor");
}

void check_payload(const at::Tensor& payload) {
  TORCH_CHECK(payload.scalar_type() == at::kByte && payload.dim() == 1 && payload.is_contiguous() && payload.is_cuda(),
              "megatron_zpp::mpc: payload must be a contiguous 1-D uint8 CUDA tensor");
}

int bits_of(const at::Tensor& t) { return t.scalar_type() == at::kFloat ? 32 : 16; }

int dtype_code_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return mpc::kFloat32;
    case at::kBFloat16: return mpc::kBFloat16;
    default: return mpc::kFloat16;
  }
}

at::Tensor mpc_encode_cuda(const at::Tensor& x, int64_t dim) {
  check_float_cuda(x, "x");
  TORCH_CHECK(dim >= 1 && dim <= 32, "megatron_zpp::mpc: dim=", dim, " is not valid; valid: 1..32");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = x.numel();
  const int bits = bits_of(x);
  const int64_t capacity = mpc::max_payload_bytes(n, bits);
  at::Tensor payload = at::empty({capacity}, x.options().dtype(at::kByte));
  at::Tensor scratch = at::empty({cuda::mpc_encode_scratch_bytes(n, bits) / 8 + 1}, x.options().dtype(at::kLong));
  cuda::launch_mpc_encode(x.data_ptr(), n, bits, dtype_code_of(x), static_cast<int>(dim),
                          payload.data_ptr<uint8_t>(), capacity, scratch.data_ptr(),
                          at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return payload;
}

void mpc_decode_cuda(const at::Tensor& payload, const at::Tensor& out, int64_t dim) {
  check_float_cuda(out, "out");
  check_payload(payload);
  TORCH_CHECK(payload.device() == out.device(), "megatron_zpp::mpc: payload is on ", payload.device(),
              ", out on ", out.device());
  TORCH_CHECK(dim >= 1 && dim <= 32, "megatron_zpp::mpc: dim=", dim, " is not valid; valid: 1..32");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(payload.data_ptr()) % 4 == 0,
              "megatron_zpp::mpc: payload must start on a 4-byte boundary");
  const int64_t n = out.numel();
  const int bits = bits_of(out);
  const int64_t need = mpc::kMpcBodyOffset + 4 * mpc::bitmap_words(n, bits);
  TORCH_CHECK(payload.numel() >= need, "megatron_zpp::mpc: payload is truncated: ", payload.numel(),
              " bytes; the header and bitmap of ", n, " values alone are ", need);
  const c10::cuda::CUDAGuard guard(out.device());
  at::Tensor scratch = at::empty({cuda::mpc_decode_scratch_bytes(n, bits) / 8 + 1}, out.options().dtype(at::kLong));
  cuda::launch_mpc_decode(payload.data_ptr<uint8_t>(), payload.numel(), out.data_ptr(), n, bits,
                          static_cast<int>(dim), scratch.data_ptr(), at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor container_checksum_cuda(const at::Tensor& payload) {
  check_payload(payload);
  const c10::cuda::CUDAGuard guard(payload.device());
  at::Tensor out = at::empty({}, payload.options().dtype(at::kLong));
  at::Tensor scratch = at::empty({1}, payload.options().dtype(at::kLong));
  cuda::launch_container_checksum(payload.data_ptr<uint8_t>(), payload.numel(), out.data_ptr<int64_t>(),
                                  scratch.data_ptr(), at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace
}  // namespace zpp

TORCH_LIBRARY_IMPL(megatron_zpp, CUDA, m) {
  m.impl("mpc_encode", &zpp::mpc_encode_cuda);
  m.impl("mpc_decode_", &zpp::mpc_decode_cuda);
  m.impl("container_checksum", &zpp::container_checksum_cuda);
}
