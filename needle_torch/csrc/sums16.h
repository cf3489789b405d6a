// sums16(a): the 16 lane sums of a[0..16) as one vector, lane j = Σ a[j]'s lanes, for kernels that add up many dot
// products at once (decode_step.cpp's bf16 products, lane_route.cpp). It halves as _mm512_reduce_add_ps halves one
// vector (lane l + l+8, then + l+4, + l+2, + l+1: the same sums bit for bit), but in 4 levels of shuffled pairs for
// all 16 at once instead of 4 levels for each. The shuffles leave lane j holding a[TREE[j]]'s sum, TREE its own
// inverse: so a is read in that order. Needs AVX-512. needle_torch.kernels.cpp_source inlines this file where a
// kernel names it in an `#include "sums16.h"` line.
constexpr int TREE[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};
__attribute__((target("avx512f")))
static inline __m512 sums16(const __m512* a) {
    __m512 c[8], d[4], e[2];
    for (int j = 0; j < 8; ++j)
        c[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a[TREE[j]], a[TREE[j + 8]], 0x44),
                             _mm512_shuffle_f32x4(a[TREE[j]], a[TREE[j + 8]], 0xEE));
    for (int j = 0; j < 4; ++j)
        d[j] = _mm512_add_ps(_mm512_shuffle_f32x4(c[j], c[j + 4], 0x88), _mm512_shuffle_f32x4(c[j], c[j + 4], 0xDD));
    for (int j = 0; j < 2; ++j)
        e[j] = _mm512_add_ps(_mm512_shuffle_ps(d[j], d[j + 2], 0x44), _mm512_shuffle_ps(d[j], d[j + 2], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], 0x88), _mm512_shuffle_ps(e[0], e[1], 0xDD));
}
