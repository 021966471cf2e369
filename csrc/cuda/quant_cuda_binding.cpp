// CUDA implementations of the torch.ops.megatron_zpp ops: argument checks, then
// the launchers of quant_kernels.cu on the current stream (no host sync).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "zpp/cuda_launchers.h"
#include "zpp/op_checks.h"
#include "zpp/quant_chunks.h"

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

// Hadamard smoothing (hadamard != 0) runs in the kernels' registers where zpp/quant_chunks.h says it is
// fused (quantizing blocks <= 2048 elements, runs <= 256 in the elementwise kernels: SDP4Bit's 32 and
// every block it uses). Other shapes compose the plain kernels with launch_hadamard_runs through fp32
// temporaries from the caching allocator, on the current stream. Both do the same operations in the
// same order as the CPU kernels and the reference (blockwise.md), so the same bits.
at::Tensor fp32_work(const at::Tensor& like, int64_t numel) {
  return at::empty({numel}, like.options().dtype(at::kFloat));
}

void rotate(at::Tensor& v, int64_t rows, int64_t length, int log2h) {
  cuda::launch_hadamard_runs(v.data_ptr<float>(), rows, length, log2h, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void quantize_any(const at::Tensor& x, const at::Tensor& packed, int64_t length, int64_t bits, int64_t block,
                  bool stochastic, int64_t seed, int log2h, bool reorder, int64_t nodes, int64_t node_size,
                  int64_t stages) {
  check_aligned(packed, "packed");
  const int64_t rows = packed.size(0);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor src = x;
  const bool fused = log2h && chunks::group_rotation_fused(block);
  if (log2h && !fused) {
    src = fp32_work(x, x.numel());
    src.copy_(x.view(-1));  // exact widening
    rotate(src, rows, length, log2h);
  }
  cuda::launch_quantize_rows(src.data_ptr(), float_type(src), packed.data_ptr<uint8_t>(), rows, length,
                             static_cast<int>(bits), block, stochastic, static_cast<uint64_t>(seed), reorder, nodes,
                             node_size, stages, at::cuda::getCurrentCUDAStream(), fused ? log2h : 0);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void quantize_rows_cuda(const at::Tensor& x, const at::Tensor& packed, int64_t bits, int64_t block, bool stochastic,
                        int64_t seed, int64_t hadamard) {
  const int64_t length = check_quantize_rows(x, packed, bits, block);
  quantize_any(x, packed, length, bits, block, stochastic, seed, check_hadamard(hadamard, block), false, 1, 1, 1);
}

void reorder_quantize_cuda(const at::Tensor& x, const at::Tensor& packed, int64_t bits, int64_t block, int64_t nodes,
                           int64_t node_size, int64_t stages, bool stochastic, int64_t seed, int64_t hadamard) {
  const int64_t length = check_reorder_quantize(x, packed, bits, block, nodes, node_size, stages);
  quantize_any(x, packed, length, bits, block, stochastic, seed, check_hadamard(hadamard, block), true, nodes,
               node_size, stages);
}

void dequantize_rows_any(const at::Tensor& packed, const at::Tensor& out, int64_t bits, int64_t block,
                         int64_t hadamard, bool accumulate) {
  const int64_t length = check_dequantize_rows(packed, out, bits, block);
  const int log2h = check_hadamard(hadamard, block);
  check_aligned(packed, "packed");
  const int64_t rows = packed.size(0);
  const c10::cuda::CUDAGuard guard(out.device());
  if (!log2h || chunks::chunk_rotation_fused(log2h)) {
    cuda::launch_dequantize_rows(packed.data_ptr<uint8_t>(), out.data_ptr(), float_type(out), rows, length,
                                 static_cast<int>(bits), block, at::cuda::getCurrentCUDAStream(), accumulate, log2h);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  // Rotated: fp32 output without accumulation is rotated where it is decoded; otherwise an fp32 temporary,
  // then (decoded + fp32(out)) and one narrowing.
  const bool in_place = out.scalar_type() == at::kFloat && !accumulate;
  at::Tensor dst = in_place ? out : fp32_work(out, out.numel());
  cuda::launch_dequantize_rows(packed.data_ptr<uint8_t>(), dst.data_ptr(), cuda::FloatType::kFloat32, rows, length,
                               static_cast<int>(bits), block, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  at::Tensor flat = dst.view(-1);
  rotate(flat, rows, length, log2h);
  if (in_place) return;
  if (accumulate) flat.add_(out.view(-1).to(at::kFloat));  // decoded + base, as the kernels add
  out.view(-1).copy_(flat);  // round to nearest even, as the kernels narrow
}

void dequantize_rows_cuda(const at::Tensor& packed, const at::Tensor& out, int64_t bits, int64_t block,
                          int64_t hadamard) {
  dequantize_rows_any(packed, out, bits, block, hadamard, false);
}

void dequantize_add_rows_cuda(const at::Tensor& packed, const at::Tensor& out, int64_t bits, int64_t block,
                              int64_t hadamard) {
  dequantize_rows_any(packed, out, bits, block, hadamard, true);
}

// The fp32 sum over the chunks of packed_in [C, K, row] (dequant_reduce with divisor 1: x / 1 is exact).
at::Tensor reduce_fp32(const at::Tensor& packed_in, int64_t length, int64_t bits, int64_t block) {
  at::Tensor acc = fp32_work(packed_in, packed_in.size(1) * length);
  cuda::launch_dequant_reduce(packed_in.data_ptr<uint8_t>(), acc.data_ptr(), cuda::FloatType::kFloat32,
                              packed_in.size(0), packed_in.size(1), length, static_cast<int>(bits), block, 1.0f,
                              at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return acc;
}

void dequant_reduce_quantize_cuda(const at::Tensor& packed_in, const at::Tensor& packed_out, int64_t row_numel,
                                  int64_t bits_in, int64_t block_in, int64_t bits_out, int64_t block_out,
                                  bool stochastic, int64_t seed, int64_t hadamard_in, int64_t hadamard_out) {
  check_dequant_reduce_quantize(packed_in, packed_out, row_numel, bits_in, block_in, bits_out, block_out);
  const int log2h_in = check_hadamard_in_out(hadamard_in, block_in, block_out, "hadamard_in");
  const int log2h_out = check_hadamard(hadamard_out, block_out, "hadamard_out");
  check_aligned(packed_in, "packed_in");
  check_aligned(packed_out, "packed_out");
  const c10::cuda::CUDAGuard guard(packed_in.device());
  const int64_t rows = packed_in.size(1);
  // Equal rotations: the sum stays in the rotated domain, as on CPU (no rotation at all).
  const int rot_in = log2h_in == log2h_out ? 0 : log2h_in, rot_out = log2h_in == log2h_out ? 0 : log2h_out;
  if ((rot_in || rot_out) && !chunks::group_rotation_fused(block_out)) {
    at::Tensor acc = reduce_fp32(packed_in, row_numel, bits_in, block_in);
    if (rot_in) rotate(acc, rows, row_numel, rot_in);
    if (rot_out) rotate(acc, rows, row_numel, rot_out);
    cuda::launch_quantize_rows(acc.data_ptr(), cuda::FloatType::kFloat32, packed_out.data_ptr<uint8_t>(), rows,
                               row_numel, static_cast<int>(bits_out), block_out, stochastic,
                               static_cast<uint64_t>(seed), false, 1, 1, 1, at::cuda::getCurrentCUDAStream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  cuda::launch_dequant_reduce_quantize(packed_in.data_ptr<uint8_t>(), packed_out.data_ptr<uint8_t>(),
                                       packed_in.size(0), rows, row_numel, static_cast<int>(bits_in),
                                       block_in, static_cast<int>(bits_out), block_out, stochastic,
                                       static_cast<uint64_t>(seed), at::cuda::getCurrentCUDAStream(), rot_in, rot_out);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void dequant_reduce_cuda(const at::Tensor& packed_in, const at::Tensor& out, int64_t bits, int64_t block,
                         double divisor, int64_t hadamard) {
  const int64_t length = check_dequant_reduce(packed_in, out, bits, block, divisor);
  const int log2h = check_hadamard(hadamard, block);
  check_aligned(packed_in, "packed_in");
  const int64_t rows = packed_in.size(1);
  const c10::cuda::CUDAGuard guard(out.device());
  if (log2h && !chunks::chunk_rotation_fused(log2h)) {
    at::Tensor acc = reduce_fp32(packed_in, length, bits, block);
    rotate(acc, rows, length, log2h);
    // Tensor / tensor: an IEEE division per element (a Python-number divisor would multiply by its reciprocal).
    acc.div_(at::full_like(acc, static_cast<float>(divisor)));
    out.view(-1).copy_(acc);
    return;
  }
  cuda::launch_dequant_reduce(packed_in.data_ptr<uint8_t>(), out.data_ptr(), float_type(out), packed_in.size(0), rows,
                              length, static_cast<int>(bits), block, static_cast<float>(divisor),
                              at::cuda::getCurrentCUDAStream(), log2h);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace zpp

TORCH_LIBRARY_IMPL(megatron_zpp, CUDA, m) {
  m.impl("quantize_rows_", &zpp::quantize_rows_cuda);
  m.impl("reorder_quantize_", &zpp::reorder_quantize_cuda);
  m.impl("dequantize_rows_", &zpp::dequantize_rows_cuda);
  m.impl("dequantize_add_rows_", &zpp::dequantize_add_rows_cuda);
  m.impl("dequant_reduce_quantize_", &zpp::dequant_reduce_quantize_cuda);
  m.impl("dequant_reduce_", &zpp::dequant_reduce_cuda);
}
