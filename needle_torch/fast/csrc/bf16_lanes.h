// Float32 vectors from and to bf16, for the kernels that hold bf16 values in float32 lanes (decode_step.cpp,
// decode_attention.cpp, hadamard_mlp.cpp, prefill_attention.cpp); the includer defines Vec
// (at::vec::Vectorized<float>). needle_torch.kernels.cpp_source inlines this file where a kernel names it in an
// `#include "bf16_lanes.h"` line.
//
// load(p): W float32 values, or W bf16 values widened to float32 from one plain load (the counted form loadu(p, W)
// of a Vectorized<BFloat16> (2W lanes) copies through the stack on AVX2: a memcpy, then a wider load that store
// forwarding cannot serve). store(p, v), its converse, below round_bf16: to bf16 it expects lanes that already hold
// bf16 values.
static inline Vec load(const float* p) { return Vec::loadu(p); }
static inline Vec load(const c10::BFloat16* p) {
    Vec out;
    at::vec::load_fp32_from_bf16(p, out);
    return out;
}

// round_bf16(v): each lane rounded to the nearest bf16 (ties to even), as float32; store_bf16(p, v): the lanes so
// rounded, stored as bf16. Where the build has AVX512-BF16 (inductor adds it for CPUs that have it), one conversion
// instruction (vcvtneps2bf16) rounds 16 lanes. It gives torch's bf16 for every float32 of magnitude 2^-126 or more
// and for the infinities; a float32 subnormal becomes a zero of its sign where torch keeps a bf16 subnormal, and a
// NaN stays a NaN of its sign where torch's is positive. Elsewhere ATen's conversion (torch's own, ~10 integer
// operations a vector), which the one instruction beats.
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
static inline Vec round_bf16(Vec v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}
static inline void store_bf16(c10::BFloat16* p, Vec v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}
#else
static inline Vec round_bf16(Vec v) {
    return std::get<0>(at::vec::convert_bfloat16_float(at::vec::convert_float_bfloat16(v, v)));
}
static inline void store_bf16(c10::BFloat16* p, Vec v) {
    at::vec::convert_float_bfloat16(v, v).store(p, Vec::size());
}
#endif

static inline void store(float* p, Vec v) { v.store(p); }
static inline void store(c10::BFloat16* p, Vec v) { store_bf16(p, v); }
