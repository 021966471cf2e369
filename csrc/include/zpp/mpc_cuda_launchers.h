// Plain-C++ entry points of the MPC CUDA kernels (csrc/cuda/mpc_kernels.cu). No torch
// headers on either side of this boundary (nvcc compiles the kernels quickly); the torch
// binding (mpc_cuda_binding.cpp) validates arguments and allocates every buffer.
// Everything runs on `stream` with no host synchronisation and no host copies.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace zpp {
namespace cuda {

// Scratch the encoder needs (bytes), for n values of `bits` (32 or 16) bits.
int64_t mpc_encode_scratch_bytes(int64_t n, int bits);

// x: n raw words (uint32 for bits=32, uint16 for 16). payload: max_payload_bytes(n, bits) bytes
// (zpp/mpc_math.h); on return it holds the container with its true length in the header.
// scratch: mpc_encode_scratch_bytes(n, bits) bytes, 8-byte aligned.
void launch_mpc_encode(const void* x, int64_t n, int bits, int dtype_code, int dim, uint8_t* payload,
                       int64_t payload_capacity, void* scratch, cudaStream_t stream);

// Scratch the decoder needs (bytes).
int64_t mpc_decode_scratch_bytes(int64_t n, int bits);

// payload: a validated container of payload_bytes bytes (the buffer's length: reads never pass it).
void launch_mpc_decode(const uint8_t* payload, int64_t payload_bytes, void* out, int64_t n, int bits, int dim,
                       void* scratch, cudaStream_t stream);

// ZPP-sum32 of a container: *out = the checksum (as int64), over the header's payload-bytes field
// clamped to buffer_bytes. scratch: 4 bytes.
void launch_container_checksum(const uint8_t* payload, int64_t buffer_bytes, int64_t* out, void* scratch,
                               cudaStream_t stream);

}  // namespace cuda
}  // namespace zpp
