// Plain-C++ entry points of the CUDA kernels (csrc/cuda/quant_kernels.cu). No
// torch headers on either side of this boundary, so nvcc compiles the kernels
// in seconds; the torch binding (quant_cuda_binding.cpp) validates arguments.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace zpp {
namespace cuda {

enum class FloatType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// log2h (every launcher): the Hadamard rotation done in registers, 0 for none; only where
// zpp/quant_chunks.h says it is fused (group_rotation_fused(block) for the quantizing kernels,
// chunk_rotation_fused(log2h) for the elementwise ones); the binding composes the other cases.

// Row r of x (R rows of `length`) goes to packed row reorder_slot_of_input_row(r)
// when reorder != 0 (stages, node_size, nodes used), else to row r. Rotated before quantizing.
void launch_quantize_rows(const void* x, FloatType type, uint8_t* packed, int64_t rows, int64_t length, int bits,
                          int64_t block, bool stochastic, uint64_t seed, bool reorder, int64_t nodes,
                          int64_t node_size, int64_t stages, cudaStream_t stream, int log2h = 0);

// accumulate: out = cast(decoded + fp32(out)) (qWD's decode-and-add). Rotated after decoding.
void launch_dequantize_rows(const uint8_t* packed, void* out, FloatType type, int64_t rows, int64_t length, int bits,
                            int64_t block, cudaStream_t stream, bool accumulate = false, int log2h = 0);

// packed_in: [chunks][rows][row_bytes(length, bits_in, block_in)]. The sum is rotated by log2h_in,
// then by log2h_out, before requantizing (equal rotations: pass 0 and 0, the sum stays rotated).
void launch_dequant_reduce_quantize(const uint8_t* packed_in, uint8_t* packed_out, int64_t chunks, int64_t rows,
                                    int64_t length, int bits_in, int64_t block_in, int bits_out, int64_t block_out,
                                    bool stochastic, uint64_t seed, cudaStream_t stream, int log2h_in = 0,
                                    int log2h_out = 0);

// The sum is rotated, then divided.
void launch_dequant_reduce(const uint8_t* packed_in, void* out, FloatType type, int64_t chunks, int64_t rows,
                           int64_t length, int bits, int64_t block, float divisor, cudaStream_t stream,
                           int log2h = 0);

// Hadamard smoothing of fp32 rows in place: every full run of 2^log2h values from each row start
// (quant_math.h hadamard_range).
void launch_hadamard_runs(float* v, int64_t rows, int64_t length, int log2h, cudaStream_t stream);

}  // namespace cuda
}  // namespace zpp
