// Blocks of bf16 dot products for the kernels that sum many of them at once (decode_step.cpp's bf16 products),
// on the CPU's AVX512-BF16 dot products (the includer checks that the CPU has them).
// needle_torch.kernels.cpp_source inlines this file where a kernel names it in an `#include "bf16_dots.h"` line.
//
// sums16(a): the 16 lane sums of a[0..16) as one vector, lane j = Σ a[j]'s lanes. It halves as _mm512_reduce_add_ps
// halves one vector (lane l + l+8, then + l+4, + l+2, + l+1: the same sums bit for bit), but in 4 levels of shuffled
// pairs for all 16 at once instead of 4 levels for each. The shuffles leave lane j holding a[TREE[j]]'s sum, TREE its
// own inverse: so a is read in that order.
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

// 4 weight rows w (at stride I) against NV <= 4 input vectors xh (at stride xstride), y[v * ystride + k] = w_k · x_v:
// each step loads the rows' 32 elements once for the NV vectors and each vector's once for the 4 rows, the float32
// sums in registers, added up together (sums16); every sum is the one _mm512_reduce_add_ps of a single accumulator
// would give. fetch: how many bytes ahead to ask for the weight rows into L2 (0: none).
template <int NV>
__attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl")))
static void block4_dp(const c10::BFloat16* w, const c10::BFloat16* xh, int64_t xstride, float* y, int64_t ystride,
                      int64_t I, int64_t fetch) {
    static_assert(1 <= NV && NV <= 4, "up to 4 input vectors");
    __m512 acc[16];  // acc[v * 4 + k]: row k, vector v (those past NV stay 0)
    for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < I; i += 32) {
        __m512bh wv[4];
        for (int k = 0; k < 4; ++k) {
            if (fetch) _mm_prefetch(reinterpret_cast<const char*>(w + k * I + i) + fetch, _MM_HINT_T2);
            wv[k] = (__m512bh)_mm512_loadu_si512(w + k * I + i);
        }
        for (int v = 0; v < NV; ++v) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512(xh + v * xstride + i);
            for (int k = 0; k < 4; ++k) acc[v * 4 + k] = _mm512_dpbf16_ps(acc[v * 4 + k], wv[k], xv);
        }
    }
    alignas(64) float out[16];
    _mm512_store_ps(out, sums16(acc));
    for (int v = 0; v < NV; ++v)
        for (int k = 0; k < 4; ++k) y[v * ystride + k] = out[v * 4 + k];
}
