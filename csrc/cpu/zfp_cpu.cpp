// CPU kernels of the ZFP fixed-rate ops (torch.ops.megatron_zpp.zfp_encode_ / zfp_decode_): C++ over
// blocks with at::parallel_for (OpenMP). Fixed-rate blocks sit at known bit offsets, so encoding is
// parallel over runs of blocks that fill whole 64-bit words and decoding over single blocks. The
// bits are defined by zpp/zfp_math.h and tested against zfpy (tests/test_zfp.py).
//
// Like the quantization kernels, the loops are compiled for the x86-64 baseline, x86-64-v3 and
// x86-64-v4 (zfp_cpu_isa.h) and run at the level quant_cpu.cpp picked (ZPP_CPU_ISA,
// torch.ops.megatron_zpp._set_cpu_isa), so one switch chooses the level of every CPU kernel.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "zpp/zfp_checks.h"
#include "zpp/zfp_math.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define ZPP_ZFP_X86_LEVELS 1
#include <immintrin.h>
#else
#define ZPP_ZFP_X86_LEVELS 0
#endif

namespace zpp {

enum class CpuDtype { kFloat32, kBFloat16, kFloat16 };

std::string active_cpu_isa();  // quant_cpu.cpp

}  // namespace zpp

#define ZPP_ZFP_ISA_NS zfp_isa_baseline
#define ZPP_ZFP_ISA_LEVEL 0
#include "zfp_cpu_isa.h"
#undef ZPP_ZFP_ISA_NS
#undef ZPP_ZFP_ISA_LEVEL

#if ZPP_ZFP_X86_LEVELS
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v3")
#define ZPP_ZFP_ISA_NS zfp_isa_x86_64_v3
#define ZPP_ZFP_ISA_LEVEL 3
#include "zfp_cpu_isa.h"
#undef ZPP_ZFP_ISA_NS
#undef ZPP_ZFP_ISA_LEVEL
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("arch=x86-64-v4")
// GCC 12's AVX-512 intrinsics headers seed "undefined" vectors with a self-initialization that
// -Wmaybe-uninitialized flags at every use (GCC bug 105593); nothing here reads an undefined lane.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define ZPP_ZFP_ISA_NS zfp_isa_x86_64_v4
#define ZPP_ZFP_ISA_LEVEL 4
#include "zfp_cpu_isa.h"
#undef ZPP_ZFP_ISA_NS
#undef ZPP_ZFP_ISA_LEVEL
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

namespace zpp {
namespace {

struct ZfpKernels {
  const char* name;  // as quant_cpu.cpp names the level
  decltype(&zfp_isa_baseline::encode) encode;
  decltype(&zfp_isa_baseline::decode) decode;
};

const ZfpKernels kZfpLevels[] = {
#if ZPP_ZFP_X86_LEVELS
    {"x86-64", &zfp_isa_baseline::encode, &zfp_isa_baseline::decode},
    {"x86-64-v3", &zfp_isa_x86_64_v3::encode, &zfp_isa_x86_64_v3::decode},
    {"x86-64-v4", &zfp_isa_x86_64_v4::encode, &zfp_isa_x86_64_v4::decode},
#else
    {"baseline", &zfp_isa_baseline::encode, &zfp_isa_baseline::decode},
#endif
};

const ZfpKernels& zfp_kernels() {
  const std::string level = active_cpu_isa();
  for (const auto& k : kZfpLevels)
    if (level == k.name) return k;
  TORCH_CHECK(false, "megatron_zpp: no ZFP kernels for CPU level '", level, "'");
}

CpuDtype cpu_dtype(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return CpuDtype::kFloat32;
    case at::kBFloat16: return CpuDtype::kBFloat16;
    default: return CpuDtype::kFloat16;  // check_float() ran first
  }
}

void zfp_encode_cpu(const at::Tensor& x, const at::Tensor& payload, int64_t dims, int64_t maxbits) {
  check_zfp_encode(x, payload, dims, maxbits);
  if (x.numel() == 0) return;
  zfp_kernels().encode(x.data_ptr(), cpu_dtype(x), x.numel(), static_cast<int>(dims), static_cast<int>(maxbits),
                       payload.data_ptr<uint8_t>());
}

void zfp_decode_cpu(const at::Tensor& payload, const at::Tensor& out, int64_t dims, int64_t maxbits) {
  check_zfp_decode(payload, out, dims, maxbits);
  if (out.numel() == 0) return;
  zfp_kernels().decode(payload.data_ptr<uint8_t>(), out.numel(), static_cast<int>(dims), static_cast<int>(maxbits),
                       out.data_ptr(), cpu_dtype(out));
}

}  // namespace
}  // namespace zpp

TORCH_LIBRARY_IMPL(megatron_zpp, CPU, m) {
  m.impl("zfp_encode_", &zpp::zfp_encode_cpu);
  m.impl("zfp_decode_", &zpp::zfp_decode_cpu);
}
