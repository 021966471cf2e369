// Argument checks shared by the CPU and CUDA bindings (host-only; includes torch).
#pragma once

#include <ATen/ATen.h>

#include "zpp/quant_math.h"

namespace zpp {

inline void check_bits_block(int64_t bits, int64_t block) {
  TORCH_CHECK(bits == 4 || bits == 8, "megatron_zpp: bits=", bits, " is not supported; valid: 4, 8");
  TORCH_CHECK(block > 0 && block % 8 == 0, "megatron_zpp: block=", block, " must be a positive multiple of 8");
}

// hadamard: 0 (off) or the Walsh-Hadamard run length, a power of two in [2, 4096] dividing the block
// (layout.check_hadamard); returns log2(hadamard), 0 when off.
inline int check_hadamard(int64_t hadamard, int64_t block, const char* name = "hadamard") {
  if (hadamard == 0) return 0;
  TORCH_CHECK(hadamard >= 2 && hadamard <= 4096 && (hadamard & (hadamard - 1)) == 0 && block % hadamard == 0,
              "megatron_zpp: ", name, "=", hadamard, " is not valid with block=", block,
              "; valid: 0 (off) or a power of two in [2, 4096] that divides the block");
  int log2h = 0;
  while ((int64_t(1) << log2h) < hadamard) ++log2h;
  return log2h;
}

// dequant_reduce_quantize_'s input rotation: its runs must also tile the output blocks the sum is
// computed in (the kernels rotate each output block's fp32 sum).
inline int check_hadamard_in_out(int64_t hadamard, int64_t block_in, int64_t block_out, const char* name) {
  const int log2h = check_hadamard(hadamard, block_in, name);
  TORCH_CHECK(block_out % (hadamard ? hadamard : 1) == 0, "megatron_zpp: ", name, "=", hadamard,
              " must also divide block_out=", block_out);
  return log2h;
}

inline void check_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf,
              "megatron_zpp: ", name, " has dtype ", t.scalar_type(), "; valid: float32, bfloat16, float16");
  TORCH_CHECK(t.is_contiguous(), "megatron_zpp: ", name, " must be contiguous");
}

inline void check_packed(const at::Tensor& t, const char* name, int64_t dim, const at::Device& device) {
  TORCH_CHECK(t.scalar_type() == at::kByte && t.dim() == dim && t.is_contiguous(), "megatron_zpp: ", name,
              " must be a contiguous ", dim, "-D uint8 tensor");
  TORCH_CHECK(t.device() == device, "megatron_zpp: ", name, " is on ", t.device(), ", expected ", device);
}

inline int64_t rows_length(int64_t total, int64_t rows, const char* op) {
  TORCH_CHECK(rows > 0 && total % rows == 0, "megatron_zpp::", op, ": ", total,
              " elements do not split into ", rows, " equal rows");
  return total / rows;
}

inline void check_row_bytes(const at::Tensor& packed, int64_t length, int64_t bits, int64_t block,
                            const char* name) {
  const int64_t expected = row_bytes(length, static_cast<int>(bits), block);
  TORCH_CHECK(packed.size(-1) == expected, "megatron_zpp: ", name, " rows have ", packed.size(-1),
              " bytes; rows of ", length, " elements at bits=", bits, ", block=", block, " need ", expected);
}

// Per-op checks, shared by the CPU and CUDA implementations; each returns the row length.
inline int64_t check_quantize_rows(const at::Tensor& x, const at::Tensor& packed, int64_t bits, int64_t block) {
  check_bits_block(bits, block);
  check_float(x, "x");
  check_packed(packed, "packed", 2, x.device());
  const int64_t length = rows_length(x.numel(), packed.size(0), "quantize_rows_");
  check_row_bytes(packed, length, bits, block, "packed");
  return length;
}

inline int64_t check_reorder_quantize(const at::Tensor& x, const at::Tensor& packed, int64_t bits, int64_t block,
                                      int64_t nodes, int64_t node_size, int64_t stages) {
  check_bits_block(bits, block);
  check_float(x, "x");
  check_packed(packed, "packed", 2, x.device());
  TORCH_CHECK(nodes >= 1 && node_size >= 1 && stages >= 1, "megatron_zpp::reorder_quantize_: nodes=", nodes,
              ", node_size=", node_size, ", stages=", stages, " must all be >= 1");
  const int64_t rows = nodes * node_size * stages;
  TORCH_CHECK(packed.size(0) == rows, "megatron_zpp::reorder_quantize_: packed has ", packed.size(0),
              " rows; stages*nodes*node_size = ", rows);
  const int64_t length = rows_length(x.numel(), rows, "reorder_quantize_");
  check_row_bytes(packed, length, bits, block, "packed");
  return length;
}

inline int64_t check_dequantize_rows(const at::Tensor& packed, const at::Tensor& out, int64_t bits, int64_t block) {
  check_bits_block(bits, block);
  check_float(out, "out");
  check_packed(packed, "packed", 2, out.device());
  const int64_t length = rows_length(out.numel(), packed.size(0), "dequantize_rows_");
  check_row_bytes(packed, length, bits, block, "packed");
  return length;
}

inline void check_dequant_reduce_quantize(const at::Tensor& packed_in, const at::Tensor& packed_out, int64_t row_numel,
                                          int64_t bits_in, int64_t block_in, int64_t bits_out, int64_t block_out) {
  check_bits_block(bits_in, block_in);
  check_bits_block(bits_out, block_out);
  check_packed(packed_in, "packed_in", 3, packed_in.device());
  check_packed(packed_out, "packed_out", 2, packed_in.device());
  TORCH_CHECK(packed_out.size(0) == packed_in.size(1), "megatron_zpp::dequant_reduce_quantize_: packed_out has ",
              packed_out.size(0), " rows, packed_in chunks have ", packed_in.size(1));
  check_row_bytes(packed_in, row_numel, bits_in, block_in, "packed_in");
  check_row_bytes(packed_out, row_numel, bits_out, block_out, "packed_out");
}

inline int64_t check_dequant_reduce(const at::Tensor& packed_in, const at::Tensor& out, int64_t bits, int64_t block,
                                    double divisor) {
  check_bits_block(bits, block);
  check_float(out, "out");
  check_packed(packed_in, "packed_in", 3, out.device());
  TORCH_CHECK(divisor > 0, "megatron_zpp::dequant_reduce_: divisor=", divisor, " must be > 0");
  const int64_t length = rows_length(out.numel(), packed_in.size(1), "dequant_reduce_");
  check_row_bytes(packed_in, length, bits, block, "packed_in");
  return length;
}

}  // namespace zpp
