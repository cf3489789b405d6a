// The Sylvester-Walsh product of one row for the kernels that run Needle 2's Hadamard MLP (decode_step.cpp,
// hadamard_mlp.cpp): z = z · cast(H_P), the unnormalised butterflies in float32, then times H_P's entry and rounded
// to SCALAR. The includer defines Vec (at::vec::Vectorized<float>), P (a power of two, a multiple of the vector
// width), W = Vec::size() and rv(Vec) (each lane rounded to SCALAR). needle_torch.kernels.cpp_source inlines this
// file where a kernel names it in an `#include "walsh.h"` line.
//
// One level of butterflies within a vector v, s its lanes swapped with their partners: v + s, and s - v in the lanes
// of HIGH (those whose partner lies below); within_vector: every level of pairs less than a vector apart.
#if defined(CPU_CAPABILITY_AVX512)
#define WITHIN_VECTOR 1
template <int HIGH>
static inline __m512 butterflies(__m512 v, __m512 s) {
    return _mm512_mask_blend_ps(HIGH, _mm512_add_ps(v, s), _mm512_sub_ps(s, v));
}
static inline Vec within_vector(__m512 v) {  // pairs 1, 2, 4 and 8 apart
    v = butterflies<0xAAAA>(v, _mm512_permute_ps(v, 0xB1));
    v = butterflies<0xCCCC>(v, _mm512_permute_ps(v, 0x4E));
    v = butterflies<0xF0F0>(v, _mm512_shuffle_f32x4(v, v, 0xB1));
    return butterflies<0xFF00>(v, _mm512_shuffle_f32x4(v, v, 0x4E));
}
#elif defined(CPU_CAPABILITY_AVX2)
#define WITHIN_VECTOR 1
template <int HIGH>
static inline __m256 butterflies(__m256 v, __m256 s) {
    return _mm256_blend_ps(_mm256_add_ps(v, s), _mm256_sub_ps(s, v), HIGH);
}
static inline Vec within_vector(__m256 v) {  // pairs 1, 2 and 4 apart
    v = butterflies<0xAA>(v, _mm256_permute_ps(v, 0xB1));
    v = butterflies<0xCC>(v, _mm256_permute_ps(v, 0x4E));
    return butterflies<0xF0>(v, _mm256_permute2f128_ps(v, v, 0x01));
}
#endif

// z = x · cast(H_P) for the Sylvester-Walsh matrix: the unnormalised butterflies in float32, times H_P's entry.
// In AVX-512 and AVX2 builds the pairs less than a vector apart (1, 2, 4 and, with AVX-512, 8) stay in registers, a
// vector at a time (other builds take them one pair at a time): each level's a + b and a - b from the vector and its
// lanes swapped by that distance, the lanes whose partner lies below taking the difference (the same butterflies as
// one pair at a time, bit for bit, and faster).
static void walsh(float* z, float entry) {
    int64_t len = 1;
#ifdef WITHIN_VECTOR
    for (int64_t i = 0; i < P; i += W) within_vector(Vec::loadu(z + i)).store(z + i);
    len = W;
#endif
    for (; len < P && len < W; len <<= 1)
        for (int64_t i = 0; i < P; i += len << 1)
            for (int64_t j = i; j < i + len; ++j) {
                float a = z[j], b = z[j + len];
                z[j] = a + b, z[j + len] = a - b;
            }
    for (; len < P; len <<= 1)
        for (int64_t i = 0; i < P; i += len << 1)
            for (int64_t j = i; j < i + len; j += W) {
                Vec a = Vec::loadu(z + j), b = Vec::loadu(z + j + len);
                (a + b).store(z + j), (a - b).store(z + j + len);
            }
    Vec e(entry);
    for (int64_t i = 0; i < P; i += W) rv(Vec::loadu(z + i) * e).store(z + i);
}
