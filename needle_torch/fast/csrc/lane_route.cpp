// Needle 2's lane-routing projections (NEEDLE_V2.md §3.8) for rows of bf16 lanes, for compiled CPU graphs: out = x̂ φᵀ
// with x̂ = rms_unit(x), written as (x φᵀ)·rsqrt(mean(x²) + 1e-6) (lanes.route's compiled float32 form: the factor
// after the sums). x and φ hold bf16 values, so every product x_i·φ_i is exact in float32 and the CPU's AVX512-BF16
// dot products sum them in float32 (pairs of exact products, as the decode kernels' bf16 products): the float32
// function up to the order of its sums and where the factor applies. Built by needle_torch/cpu_route.py through
// inductor's C++ toolchain for CPUs with those dot products, with WIDTH (n·D, a multiple of 32) and OUTS (Σ out, a
// multiple of 4) defined in front.
//
// x (rows, WIDTH) bf16; phi (OUTS, WIDTH) bf16; out (rows, OUTS) float32.
#include <torch/csrc/inductor/cpp_prefix.h>
#include <cmath>

constexpr int64_t I = WIDTH, O = OUTS;
static_assert(I % 32 == 0 && O % 4 == 0, "width a multiple of 32, outputs a multiple of 4");
constexpr float EPS = 1e-6f;
using bf16 = c10::BFloat16;
#define DP_TARGET __attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl")))

#include "bf16_dots.h"

// rsqrt(mean(f32(x)²) + eps) of one row
DP_TARGET static inline float factor(const bf16* x) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < I; i += 16) {
        __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(x + i))), 16));
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    return 1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / float(I) + EPS);
}

// nv (<= 4) rows of x against the 4 rows of φ from o: y[v][k] = x_v · φ_(o+k) (bf16_dots.h's block4_dp)
static void block(const bf16* x, int64_t nv, const bf16* phi, float (*y)[4]) {
    switch (nv) {
        case 4: return block4_dp<4>(phi, x, I, y[0], 4, I, 0);
        case 3: return block4_dp<3>(phi, x, I, y[0], 4, I, 0);
        case 2: return block4_dp<2>(phi, x, I, y[0], 4, I, 0);
        default: return block4_dp<1>(phi, x, I, y[0], 4, I, 0);
    }
}

extern "C" void kernel(const bf16* x, const bf16* phi, float* out, int64_t rows) {
    #pragma omp parallel for schedule(static)
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {  // 4 rows at a time: φ (L2-resident) read once for the 4
        const int64_t nv = rows - r0 < 4 ? rows - r0 : 4;
        const bf16* xr = x + r0 * I;
        float f[4];
        for (int64_t v = 0; v < nv; ++v) f[v] = factor(xr + v * I);
        for (int64_t o = 0; o < O; o += 4) {
            float y[4][4];
            block(xr, nv, phi + o * I, y);
            for (int64_t v = 0; v < nv; ++v)
                for (int k = 0; k < 4; ++k) out[(r0 + v) * O + o + k] = y[v][k] * f[v];
        }
    }
}
