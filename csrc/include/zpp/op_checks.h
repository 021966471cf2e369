// Argument checks shared by the CPU and CUDA bindings (host-only; includes torch).
#pragma once

#include <ATen/ATen.h>

#include "zpp/quant_math.h"

namespace zpp {

inline void check_bits_block(int64_t bits, int64_t block) {
  TORCH_CHECK(bits == 4 || bits == 8, "megatron_zpp: bits=", bits, " is not supported; valid: 4, 8");
  TORCH_CHECK(block > 0 && block % 8 == 0, "megatron_zpp: block=", block, " must be a positive multiple of 8");
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

}  // namespace zpp
