// The Hadamard MLP of Needle 2 (NEEDLE_V2.md §3.5) over rows of float32, for compiled CPU graphs: per row, z = (d1 ⊙
// pad_P(x))·H_P, z = silu(d2 ⊙ z)·H_P, out = (d3 ⊙ z)[:D]. H_P's product is the unnormalised butterflies in float32
// times H_P's entry cast(1/√P) (the dense product's terms in another order); everything else is the torch form's
// float32 arithmetic. Built by needle_torch/cpu_hadamard.py through inductor's C++ toolchain, with DMODEL (D) and
// HADA (P, a power of two >= D) defined in front; both multiples of the vector width.
//
// x, out (rows, D); d1, d2, d3 (P,).
#include <torch/csrc/inductor/cpp_prefix.h>

using Vec = at::vec::Vectorized<float>;
constexpr int64_t D = DMODEL, P = HADA, W = Vec::size();
static_assert(D % W == 0 && P % W == 0, "widths must be multiples of the vector width");
constexpr int64_t BLOCK = P / W < 8 ? P / W : 8;  // P / W is a power of two, so BLOCK divides it

// H_W's rows (entries ±1) for the butterflies within one vector of W lanes (Sylvester order: H_2m = [[H, H], [H, -H]])
struct WithinVector {
    Vec rows[W];
    WithinVector() {
        for (int64_t j = 0; j < W; ++j) {
            alignas(64) float row[W];
            for (int64_t k = 0; k < W; ++k) row[k] = __builtin_popcountll(j & k) % 2 ? -1.0f : 1.0f;
            rows[j] = Vec::loadu(row);
        }
    }
};

// z = z · H_P (H_P = H_(P/W) ⊗ H_W): the butterflies of pairs less than W apart as one product of each vector with H_W
// (W multiply-adds of ±1 terms), then the butterflies across vectors (pairs W, 2W, ..., P/2 apart), then times
// H_P's entry; all in float32
static void walsh(float* z, float entry, const WithinVector& hw) {
    for (int64_t i = 0; i < P; i += BLOCK * W) {  // BLOCK vectors at a time: independent chains of multiply-adds
        Vec acc[BLOCK];
        for (int64_t b = 0; b < BLOCK; ++b) acc[b] = Vec(0);
        for (int64_t j = 0; j < W; ++j)
            for (int64_t b = 0; b < BLOCK; ++b) acc[b] = at::vec::fmadd(Vec(z[i + b * W + j]), hw.rows[j], acc[b]);
        for (int64_t b = 0; b < BLOCK; ++b) acc[b].store(z + i + b * W);
    }
    for (int64_t len = W; len < P; len <<= 1)
        for (int64_t i = 0; i < P; i += len << 1)
            for (int64_t j = i; j < i + len; j += W) {
                Vec a = Vec::loadu(z + j), b = Vec::loadu(z + j + len);
                (a + b).store(z + j), (a - b).store(z + j + len);
            }
    Vec e(entry);
    for (int64_t i = 0; i < P; i += W) (Vec::loadu(z + i) * e).store(z + i);
}

extern "C" void kernel(const float* x, const float* d1, const float* d2, const float* d3, float* out, int64_t rows,
                       float entry) {
    static const WithinVector hw;
    #pragma omp parallel
    {
        alignas(64) float z[P];
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
            const float* xr = x + r * D;
            for (int64_t i = 0; i < P; i += W)
                (i < D ? Vec::loadu(d1 + i) * Vec::loadu(xr + i) : Vec(0)).store(z + i);
            walsh(z, entry, hw);
            for (int64_t i = 0; i < P; i += W) {
                Vec v = Vec::loadu(d2 + i) * Vec::loadu(z + i);
                (v * (Vec(1) / (Vec(1) + v.neg().exp()))).store(z + i);
            }
            walsh(z, entry, hw);
            for (int64_t d = 0; d < D; d += W) (Vec::loadu(d3 + d) * Vec::loadu(z + d)).store(out + r * D + d);
        }
    }
}
