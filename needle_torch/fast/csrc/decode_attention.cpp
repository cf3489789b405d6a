// Decode attention on CPU: one query per (row, query head) over a K/V cache, upstream's flash arithmetic
// (NEEDLE_V2.md §3.4): float32 logits q·kᵀ·scale of the stored keys, masked keys at a large finite negative,
// float32 softmax, probabilities rounded to the cache dtype, p·v summed in float32 and rounded once to it.
// Built by needle_torch/cpu_attention.py through inductor's C++ toolchain, with these defined in front:
// SCALAR (float or c10::BFloat16), GROUP (query heads per kv head, consecutive), HEAD (head dim).
//
// Why: a compiled step's attention as fused torch ops reads the cache slowly (one horizontal sum per key and query
// head, one pass of the cache per query head); here each (row, kv head) streams its K rows once for
// all its query heads, then its V rows once, and skips masked keys (the buffer past the current position).
//
// q (B, K, GROUP, HEAD) float32; k, v (B, K, M, HEAD) SCALAR; mask (B, M) bool (true: attend); out like q, SCALAR.
#include <torch/csrc/inductor/cpp_prefix.h>
#include <vector>

using scalar_t = SCALAR;
using Vec = at::vec::Vectorized<float>;
constexpr int64_t G = GROUP, H = HEAD, W = Vec::size(), J = HEAD / Vec::size();
static_assert(HEAD % Vec::size() == 0, "head dim must be a multiple of the vector width");

#include "bf16_lanes.h"

extern "C" void kernel(const float* q, const scalar_t* k, const scalar_t* v, const bool* mask, scalar_t* out,
                       int64_t B, int64_t K, int64_t M, float scale, float masked) {
    #pragma omp parallel
    {
        std::vector<float> s(G * M);
        #pragma omp for schedule(static)
        for (int64_t u = 0; u < B * K; ++u) {
            const bool* mk = mask + (u / K) * M;
            const scalar_t* ku = k + u * M * H;
            const scalar_t* vu = v + u * M * H;
            Vec qv[G][J];
            for (int64_t g = 0; g < G; ++g)
                for (int64_t j = 0; j < J; ++j) qv[g][j] = Vec::loadu(q + (u * G + g) * H + j * W);
            float mx[G];
            for (int64_t g = 0; g < G; ++g) mx[g] = masked;
            int64_t seen = 0;
            for (int64_t m = 0; m < M; ++m) {
                if (!mk[m]) {
                    for (int64_t g = 0; g < G; ++g) s[g * M + m] = masked;
                    continue;
                }
                ++seen;
                Vec kr[J];
                for (int64_t j = 0; j < J; ++j) kr[j] = load(ku + m * H + j * W);
                for (int64_t g = 0; g < G; ++g) {
                    Vec acc = qv[g][0] * kr[0];
                    for (int64_t j = 1; j < J; ++j) acc = at::vec::fmadd(qv[g][j], kr[j], acc);
                    float d = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc) * scale;
                    s[g * M + m] = d;
                    mx[g] = d > mx[g] ? d : mx[g];
                }
            }
            // softmax over the M logits of each query head; masked ones hold `masked`, so exp gives exactly 0 unless
            // every key is masked, where all logits are equal and the weights uniform (the reference's result)
            for (int64_t g = 0; g < G; ++g) {
                float* sg = s.data() + g * M;
                Vec vmx(mx[g]), vsum(0.f);
                int64_t m = 0;
                for (; m + W <= M; m += W) {
                    Vec e = (Vec::loadu(sg + m) - vmx).exp();
                    e.store(sg + m);
                    vsum = vsum + e;
                }
                float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, vsum);
                for (; m < M; ++m) { sg[m] = std::exp(sg[m] - mx[g]); sum += sg[m]; }
                for (m = 0; m < M; ++m) sg[m] = static_cast<float>(static_cast<scalar_t>(sg[m] / sum));
            }
            Vec acc[G][J];
            for (int64_t g = 0; g < G; ++g)
                for (int64_t j = 0; j < J; ++j) acc[g][j] = Vec(0.f);
            for (int64_t m = 0; m < M; ++m) {
                if (seen && !mk[m]) continue;
                Vec vr[J];
                for (int64_t j = 0; j < J; ++j) vr[j] = load(vu + m * H + j * W);
                for (int64_t g = 0; g < G; ++g) {
                    Vec p(s[g * M + m]);
                    for (int64_t j = 0; j < J; ++j) acc[g][j] = at::vec::fmadd(p, vr[j], acc[g][j]);
                }
            }
            for (int64_t g = 0; g < G; ++g) {
                float tmp[H];
                for (int64_t j = 0; j < J; ++j) acc[g][j].store(tmp + j * W);
                scalar_t* o = out + (u * G + g) * H;
                for (int64_t d = 0; d < H; ++d) o[d] = static_cast<scalar_t>(tmp[d]);
            }
        }
    }
}
