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
  check_bits_block(bits, block);
  check_float(x, "x");
  check_packed(packed, "packed", 2, x.device());
  check_aligned(packed, "packed");
  const int64_t rows = packed.size(0);
  const int64_t length = rows_length(x.numel(), rows, "quantize_rows_");
  check_row_bytes(packed, length, bits, block, "packed");
  const c10::cuda::CUDAGuard guard(x.device());
  cuda::launch_quantize_rows(x.data_ptr(), float_type(x), packed.data_ptr<uint8_t>(), rows, length,
                             static_cast<int>(bits), block, stochastic, static_cast<uint64_t>(seed), false, 1, 1, 1,
                             at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void reorder_quantize_cuda(const at::Tensor& x, const at::Tensor& packed, int64_t bits, int64_t block, int64_t nodes,
                           int64_t node_size, int64_t stages, bool stochastic, int64_t seed) {
  check_bits_block(bits, block);
  check_float(x, "x");
  check_packed(packed, "packed", 2, x.device());
  check_aligned(packed, "packed");
  TORCH_CHECK(nodes >= 1 && node_size >= 1 && stages >= 1, "megatron_zpp::reorder_quantize_: nodes=", nodes,
              ", node_size=", node_size, ", stages=", stages, " must all be >= 1");
  const int64_t rows = nodes * node_size * stages;
  TORCH_CHECK(packed.size(0) == rows, "megatron_zpp::reorder_quantize_: packed has ", packed.size(0),
              " rows; stages*nodes*node_size = ", rows);
  const int64_t length = rows_length(x.numel(), rows, "reorder_quantize_");
  check_row_bytes(packed, length, bits, block, "packed");
  const c10::cuda::CUDAGuard guard(x.device());
  cuda::launch_quantize_rows(x.data_ptr(), float_type(x), packed.data_ptr<uint8_t>(), rows, length,
                             static_cast<int>(bits), block, stochastic, static_cast<uint64_t>(seed), true, nodes,
                             node_size, stages, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void dequantize_rows_cuda(const at::Tensor& packed, const at::Tensor& out, int64_t bits, int64_t block) {
  check_bits_block(bits, block);
  check_float(out, "out");
  check_packed(packed, "packed", 2, out.device());
  check_aligned(packed, "packed");
  const int64_t rows = packed.size(0);
  const int64_t length = rows_length(out.numel(), rows, "dequantize_rows_");
  check_row_bytes(packed, length, bits, block, "packed");
  const c10::cuda::CUDAGuard guard(out.device());
  cuda::launch_dequantize_rows(packed.data_ptr<uint8_t>(), out.data_ptr(), float_type(out), rows, length,
                               static_cast<int>(bits), block, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void dequant_reduce_quantize_cuda(const at::Tensor& packed_in, const at::Tensor& packed_out, int64_t row_numel,
                                  int64_t bits_in, int64_t block_in, int64_t bits_out, int64_t block_out,
                                  bool stochastic, int64_t seed) {
  check_bits_block(bits_in, block_in);
  check_bits_block(bits_out, block_out);
  check_packed(packed_in, "packed_in", 3, packed_in.device());
  check_packed(packed_out, "packed_out", 2, packed_in.device());
  check_aligned(packed_in, "packed_in");
  check_aligned(packed_out, "packed_out");
  TORCH_CHECK(packed_out.size(0) == packed_in.size(1), "megatron_zpp::dequant_reduce_quantize_: packed_out has ",
              packed_out.size(0), " rows, packed_in chunks have ", packed_in.size(1));
  check_row_bytes(packed_in, row_numel, bits_in, block_in, "packed_in");
  check_row_bytes(packed_out, row_numel, bits_out, block_out, "packed_out");
  const c10::cuda::CUDAGuard guard(packed_in.device());
  cuda::launch_dequant_reduce_quantize(packed_in.data_ptr<uint8_t>(), packed_out.data_ptr<uint8_t>(),
                                       packed_in.size(0), packed_in.size(1), row_numel, static_cast<int>(bits_in),
                                       block_in, static_cast<int>(bits_out), block_out, stochastic,
                                       static_cast<uint64_t>(seed), at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void dequant_reduce_cuda(const at::Tensor& packed_in, const at::Tensor& out, int64_t bits, int64_t block,
                         double divisor) {
  check_bits_block(bits, block);
  check_float(out, "out");
  check_packed(packed_in, "packed_in", 3, out.device());
  check_aligned(packed_in, "packed_in");
  TORCH_CHECK(divisor > 0, "megatron_zpp::dequant_reduce_: divisor=", divisor, " must be > 0");
  const int64_t rows = packed_in.size(1);
  const int64_t length = rows_length(out.numel(), rows, "dequant_reduce_");
  check_row_bytes(packed_in, length, bits, block, "packed_in");
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
