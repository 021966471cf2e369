// CUDA implementations of the torch.ops.megatron_zpp ops: argument checks, then
// the launchers of quant_kernels.cu on the current stream (no host sync).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "zpp/cuda_launchers.h"
#include "zpp/op_checks.h"

namespace zpp {
namespace {

cuda::FloatType float_type(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return cuda::FloatType::kFloat32;
    case at::kBFloat16: return cuda::FloatType::kBFloat16;
    default: return cuda::FloatType::kFloat16;  // check_float() ran first
  }
}

void check_aligned(const at::Tensor& packed, const char* name) {
  // Scales are read and written as float: rows start on 4-byte boundaries.
  TORCH_CHECK(reinterpret_cast<uintptr_t>(packed.data_ptr()) % 4 == 0, "megatron_zpp: ", name,
              " must start on a 4-byte boundary");
}

void quantize_rows_cuda(const at::Tensor& x, const at::Tensor& packed, int64_t bits, int64_t block, bool stochastic,
                        int64_t seed) {
  const int64_t length = check_quantize_rows(x, packed, bits, block);
  check_aligned(packed, "packed");
  const int64_t rows = packed.size(0);
  const c10::cuda::CUDAGuard guard(x.device());
  cuda::launch_quantize_rows(x.data_ptr(), float_type(x), packed.data_ptr<uint8_t>(), rows, length,
                             static_cast<int>(bits), block, stochastic, static_cast<uint64_t>(seed), false, 1, 1, 1,
                             at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void reorder_quantize_cuda(const at::Tensor& x, const at::Tensor& packed, int64_t bits, int64_t block, int64_t nodes,
                           int64_t node_size, int64_t stages, bool stochastic, int64_t seed) {
  const int64_t length = check_reorder_quantize(x, packed, bits, block, nodes, node_size, stages);
  check_aligned(packed, "packed");
  const int64_t rows = packed.size(0);
  const c10::cuda::CUDAGuard guard(x.device());
  cuda::launch_quantize_rows(x.data_ptr(), float_type(x), packed.data_ptr<uint8_t>(), rows, length,
                             static_cast<int>(bits), block, stochastic, static_cast<uint64_t>(seed), true, nodes,
                             node_size, stages, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void dequantize_rows_cuda(const at::Tensor& packed, const at::Tensor& out, int64_t bits, int64_t block) {
  const int64_t length = check_dequantize_rows(packed, out, bits, block);
  check_aligned(packed, "packed");
  const int64_t rows = packed.size(0);
  const c10::cuda::CUDAGuard guard(out.device());
  cuda::launch_dequantize_rows(packed.data_ptr<uint8_t>(), out.data_ptr(), float_type(out), rows, length,
                               static_cast<int>(bits), block, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void dequant_reduce_quantize_cuda(const at::Tensor& packed_in, const at::Tensor& packed_out, int64_t row_numel,
                                  int64_t bits_in, int64_t block_in, int64_t bits_out, int64_t block_out,
                                  bool stochastic, int64_t seed) {
  check_dequant_reduce_quantize(packed_in, packed_out, row_numel, bits_in, block_in, bits_out, block_out);
  check_aligned(packed_in, "packed_in");
  check_aligned(packed_out, "packed_out");
  const c10::cuda::CUDAGuard guard(packed_in.device());
  cuda::launch_dequant_reduce_quantize(packed_in.data_ptr<uint8_t>(), packed_out.data_ptr<uint8_t>(),
                                       packed_in.size(0), packed_in.size(1), row_numel, static_cast<int>(bits_in),
                                       block_in, static_cast<int>(bits_out), block_out, stochastic,
                                       static_cast<uint64_t>(seed), at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void dequant_reduce_cuda(const at::Tensor& packed_in, const at::Tensor& out, int64_t bits, int64_t block,
                         double divisor) {
  const int64_t length = check_dequant_reduce(packed_in, out, bits, block, divisor);
  check_aligned(packed_in, "packed_in");
  const int64_t rows = packed_in.size(1);
  const c10::cuda::CUDAGuard guard(out.device());
  cuda::launch_dequant_reduce(packed_in.data_ptr<uint8_t>(), out.data_ptr(), float_type(out), packed_in.size(0), rows,
                              length, static_cast<int>(bits), block, static_cast<float>(divisor),
                              at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace zpp

TORCH_LIBRARY_IMPL(megatron_zpp, CUDA, m) {
  m.impl("quantize_rows_", &zpp::quantize_rows_cuda);
  m.impl("reorder_quantize_", &zpp::reorder_quantize_cuda);
  m.impl("dequantize_rows_", &zpp::dequantize_rows_cuda);
  m.impl("dequant_reduce_quantize_", &zpp::dequant_reduce_quantize_cuda);
  m.impl("dequant_reduce_", &zpp::dequant_reduce_cuda);
}
