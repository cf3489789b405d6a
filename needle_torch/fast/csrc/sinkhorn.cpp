// Needle 2's lane-routing Sinkhorn (NEEDLE_V2.md §3.8) over rows of (n, n) float32 logits, for compiled CPU graphs:
// `iters` times, each row of the matrix then each column less its logsumexp (max + log Σ exp(z - max), the n terms in
// order, as lanes._logsumexp writes it), then exp. W rows at a time, transposed into the lanes of one vector per
// matrix entry, so every step is a full-vector op on registers. Built by needle_torch/cpu_sinkhorn.py through
// inductor's C++ toolchain, with LANES (n) defined in front.
//
// z, out (rows, n, n).
#include <torch/csrc/inductor/cpp_prefix.h>
#include <algorithm>

using Vec = at::vec::Vectorized<float>;
constexpr int64_t N = LANES, NN = LANES * LANES, W = Vec::size();

// z[first + k·step] -= logsumexp over k < N
static inline void normalise(Vec* z, int64_t first, int64_t step) {
    Vec m = z[first];
    for (int64_t k = 1; k < N; ++k) m = at::vec::maximum(m, z[first + k * step]);
    Vec total = (z[first] - m).exp();
    for (int64_t k = 1; k < N; ++k) total = total + (z[first + k * step] - m).exp();
    Vec lse = m + total.log();
    for (int64_t k = 0; k < N; ++k) z[first + k * step] = z[first + k * step] - lse;
}

extern "C" void kernel(const float* in, float* out, int64_t rows, int64_t iters) {
    #pragma omp parallel
    {
        alignas(64) float buf[NN * W];
        #pragma omp for schedule(static)
        for (int64_t r0 = 0; r0 < rows; r0 += W) {
            const int64_t n = std::min(W, rows - r0);
            for (int64_t e = 0; e < NN; ++e)
                for (int64_t l = 0; l < W; ++l) buf[e * W + l] = l < n ? in[(r0 + l) * NN + e] : 0.0f;
            Vec z[NN];
            for (int64_t e = 0; e < NN; ++e) z[e] = Vec::loadu(buf + e * W);
            for (int64_t t = 0; t < iters; ++t) {
                for (int64_t i = 0; i < N; ++i) normalise(z, i * N, 1);  // rows
                for (int64_t j = 0; j < N; ++j) normalise(z, j, N);  // columns
            }
            for (int64_t e = 0; e < NN; ++e) z[e].exp().store(buf + e * W);
            for (int64_t e = 0; e < NN; ++e)
                for (int64_t l = 0; l < n; ++l) out[(r0 + l) * NN + e] = buf[e * W + l];
        }
    }
}
