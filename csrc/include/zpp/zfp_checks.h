// Argument checks of the ZFP ops, shared by the CPU and CUDA bindings (host-only; includes torch).
#pragma once

#include <ATen/ATen.h>

#include "zpp/op_checks.h"
#include "zpp/zfp_math.h"

namespace zpp {

inline void check_zfp_params(int64_t dims, int64_t maxbits) {
  TORCH_CHECK(dims >= 1 && dims <= 3, "megatron_zpp: zfp dims=", dims, " is not supported; valid: 1, 2, 3");
  TORCH_CHECK(maxbits >= zfp::kMinMaxbits && maxbits <= zfp::kMaxMaxbits, "megatron_zpp: zfp maxbits=", maxbits,
              " is not valid; valid: ", zfp::kMinMaxbits, " to ", zfp::kMaxMaxbits, " bits per block");
}

inline void check_zfp_payload(const at::Tensor& payload, int64_t numel, int64_t dims, int64_t maxbits,
                              const at::Device& device) {
  check_packed(payload, "payload", 1, device);
  const int64_t expected = zfp::payload_bytes(numel, static_cast<int>(dims), maxbits);
  TORCH_CHECK(payload.numel() == expected, "megatron_zpp: zfp payload has ", payload.numel(), " bytes; ", numel,
              " values at dims=", dims, ", maxbits=", maxbits, " need ", expected);
}

inline void check_zfp_encode(const at::Tensor& x, const at::Tensor& payload, int64_t dims, int64_t maxbits) {
  check_zfp_params(dims, maxbits);
  check_float(x, "x");
  check_zfp_payload(payload, x.numel(), dims, maxbits, x.device());
}

inline void check_zfp_decode(const at::Tensor& payload, const at::Tensor& out, int64_t dims, int64_t maxbits) {
  check_zfp_params(dims, maxbits);
  check_float(out, "out");
  check_zfp_payload(payload, out.numel(), dims, maxbits, out.device());
}

}  // namespace zpp
