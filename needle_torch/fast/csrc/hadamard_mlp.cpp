// The Hadamard MLP of Needle 2 (NEEDLE_V2.md §3.5) over rows of float32 or bf16, for compiled CPU graphs: per row,
// z = (d1 ⊙ pad_P(x))·H_P, z = silu(d2 ⊙ z)·H_P, out = (d3 ⊙ z)[:D]. H_P's product is walsh.h's, the decoding step's
// too: the unnormalised butterflies in float32 times H_P's entry cast(1/√P) (the dense product's terms in another
// order); everything else is the eager twin's arithmetic: in float32 its float32 ops, in bf16 every op's float32
// value rounded to bf16 where eager's bf16 tensors round (the products with d1, d2, d3, each Walsh product once, the
// sigmoid's exp, sum and quotient, the silu's product: rv() below, the identity in float32), as decode_step.cpp's
// MLP. Built by needle_torch/cpu_hadamard.py through inductor's C++ toolchain, with SCALAR (float or c10::BFloat16),
// DMODEL (D) and HADA (P, a power of two >= D) defined in front; both multiples of the vector width.
//
// x, out (rows, D) SCALAR; d1, d2, d3 (P,) SCALAR.
#include <torch/csrc/inductor/cpp_prefix.h>

using T = SCALAR;
using Vec = at::vec::Vectorized<float>;
constexpr int64_t D = DMODEL, P = HADA, W = Vec::size();
static_assert(D % W == 0 && P % W == 0, "widths must be multiples of the vector width");

#include "bf16_lanes.h"
// round every lane to SCALAR (round_bf16); the identity in float32
static inline Vec rv(Vec v) {
    if constexpr (std::is_same_v<T, float>) return v;
    else return round_bf16(v);
}

#include "walsh.h"

extern "C" void kernel(const T* x, const T* d1, const T* d2, const T* d3, T* out, int64_t rows, float entry) {
    const Vec one(1.0f);
    #pragma omp parallel
    {
        alignas(64) float z[P];
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < rows; ++i) {
            const T* xr = x + i * D;
            for (int64_t j = 0; j < P; j += W) (j < D ? rv(load(d1 + j) * load(xr + j)) : Vec(0)).store(z + j);
            walsh(z, entry);
            for (int64_t j = 0; j < P; j += W) {  // silu(v) = v · σ(v), σ(v) = 1 / (1 + exp(-v))
                Vec v = rv(load(d2 + j) * Vec::loadu(z + j));
                rv(v * rv(one / rv(one + rv(v.neg().exp())))).store(z + j);
            }
            walsh(z, entry);
            for (int64_t d = 0; d < D; d += W) store(out + i * D + d, rv(load(d3 + d) * Vec::loadu(z + d)));
        }
    }
}
