// Causal prefill attention on CPU: the T queries of each row are the last T of its S cached keys, and each block of
// `qblock` queries reads only the keys up to its last query. SDPA's float32 arithmetic with an additive mask
// (model.dot_product_attention, NEEDLE_V2.md §3.4): logits q·kᵀ·scale + bias (the bias 0 or a large finite negative,
// so a masked logit is exactly the bias and a fully masked query a uniform average over its block's keys, as SDPA
// over the same keys gives), softmax, p·v; in float32 the weights are normalised after p·v (one multiply by 1/Σ per
// output), the same function up to the order of the float32 operations. In bf16 (SCALAR c10::BFloat16) it is the
// twin's bf16 flash attention: q, k, v widened to float32 (exact), float32 logits and softmax (the weights times
// 1/Σ), the weights rounded to bf16 before p·v (as eager's probabilities cast to v's dtype), p·v summed in float32
// and rounded once to bf16 (bf16_lanes.h), with the sums on the CPU's AVX512-BF16 dot products where the caller
// found them (attend_dp). Built by needle_torch/cpu_prefill.py through inductor's C++ toolchain, with these
// defined in front: SCALAR (float or c10::BFloat16: q, k, v and out; the bias is float32), GROUP (query heads per
// kv head, consecutive) and HEAD (head dim).
//
// Why: torch's CPU flash kernel runs these shapes (32 queries, up to a few hundred keys, head dim 64) at about a third
// of the CPU's float32 peak. Here each (row, kv head) transposes its keys once; every block computes its logits as
// register tiles of query rows x 2 vectors of keys (the GROUP query heads of a kv head share the key loads), then
// p·v as tiles of 4 query rows x vectors of the head dim, the tiles sized to the vector registers the build has.
//
// q (B, T, K·GROUP, HEAD) and out the same, contiguous; k, v: key j of kv head kk in row b at b·kv_b + kk·kv_k +
// j·HEAD (S keys), key S - T + t query t's last; bias (B, T, S).
#include <torch/csrc/inductor/cpp_prefix.h>
#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

using Vec = at::vec::Vectorized<float>;
#include "bf16_lanes.h"
constexpr int64_t G = GROUP, H = HEAD, W = Vec::size(), J = HEAD / Vec::size(), KB = 2 * Vec::size();
// Tiles by register file: AVX-512 builds have 32 vector registers, AVX2 ones (x86-64-v3: no EVEX encoding) 16, where
// the 32-register tiles spill, so each build takes tiles that fit its register file.
#ifdef __AVX512F__
constexpr int64_t QR = 8, PR = 4, PC = J;  // query rows of a logits tile; query rows x vectors of a p·v tile
#else
constexpr int64_t QR = 6, PR = 4, PC = 2;
#endif
static_assert(HEAD % Vec::size() == 0, "head dim must be a multiple of the vector width");
static_assert(J % PC == 0, "a p·v tile's vectors must divide the head dim's");

// n bf16 values (a multiple of W) as float32, exactly, through one plain 16-byte load per vector (the counted
// Vectorized<BFloat16> load copies through the stack on AVX2)
static inline void widen(const c10::BFloat16* src, float* dst, int64_t n) {
    for (int64_t i = 0; i < n; i += W) {
        Vec x;
        at::vec::load_fp32_from_bf16(src + i, x);
        x.store(dst + i);
    }
}

// One logits row's two vectors of keys from j0 on: acc·scale + bias, the bias read up to kend only (n0, n1 of each
// vector's keys), stored to sr.
static inline void store_logits(const Vec& a0, const Vec& a1, const float* br, float* sr, int64_t kend, int64_t j0,
                                float scale) {
    const int64_t n0 = std::clamp<int64_t>(kend - j0, 0, W), n1 = std::clamp<int64_t>(kend - j0 - W, 0, W);
    const Vec sc(scale);
    const Vec b0 = n0 == W ? Vec::loadu(br) : Vec::loadu(br, n0);
    const Vec b1 = n1 == W ? Vec::loadu(br + W) : Vec::loadu(br + W, n1);
    at::vec::fmadd(a0, sc, b0).store(sr);
    at::vec::fmadd(a1, sc, b1).store(sr + W);
}

// A row's kend logits to their exponentials e^(s - max), in place; returns 1/Σ.
static inline float exp_row(float* sr, int64_t kend) {
    Vec vmx(std::numeric_limits<float>::lowest());
    int64_t j = 0;
    for (; j + W <= kend; j += W) vmx = at::vec::maximum(vmx, Vec::loadu(sr + j));
    float mx = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, vmx);
    for (; j < kend; ++j) mx = sr[j] > mx ? sr[j] : mx;
    const Vec vm(mx);
    Vec vsum(0.f);
    for (j = 0; j + W <= kend; j += W) {
        const Vec e = (Vec::loadu(sr + j) - vm).exp();
        e.store(sr + j);
        vsum = vsum + e;
    }
    float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, vsum);
    for (; j < kend; ++j) { sr[j] = std::exp(sr[j] - mx); sum += sr[j]; }
    return 1.f / sum;
}

// U: SCALAR (a template, so that each branch on it is compiled for its own type only)
template <class U>
static void attend(const U* q, const U* k, const U* v, const float* bias, U* out, int64_t B, int64_t K, int64_t T,
                   int64_t S, int64_t kv_b, int64_t kv_k, float scale, int64_t qblock) {
    constexpr bool BF16 = !std::is_same_v<U, float>;
    const int64_t Sp = (S + KB - 1) / KB * KB;  // keys padded to whole tiles (the padding is never read as a weight)
    const int64_t rows_max = qblock * G;
    #pragma omp parallel
    {
        std::vector<float> kt(H * Sp);          // this (row, kv head)'s keys transposed: kt[d·Sp + j]
        std::vector<float> s(rows_max * Sp);    // a block's logits, then its unnormalised weights
        std::vector<float> inv(rows_max);
        std::vector<const float*> qrow(rows_max);
        // bf16: this (row, kv head)'s keys and values and a block's queries widened to float32
        std::vector<float> kf(BF16 ? S * H : 0), vf(BF16 ? S * H : 0), qf(BF16 ? rows_max * H : 0);
        #pragma omp for schedule(static)
        for (int64_t u = 0; u < B * K; ++u) {
            const int64_t b = u / K, kk = u % K;
            const float* ku;
            const float* vu;
            if constexpr (BF16) {
                widen(k + b * kv_b + kk * kv_k, kf.data(), S * H);
                widen(v + b * kv_b + kk * kv_k, vf.data(), S * H);
                ku = kf.data();
                vu = vf.data();
            } else {
                ku = k + b * kv_b + kk * kv_k;
                vu = v + b * kv_b + kk * kv_k;
            }
            at::vec::transpose_mxn<float>(ku, H, kt.data(), Sp, S, H);
            for (int64_t j = S; j < Sp; ++j)
                for (int64_t d = 0; d < H; ++d) kt[d * Sp + j] = 0.f;
            for (int64_t a = 0; a < T; a += qblock) {
                const int64_t nt = std::min<int64_t>(qblock, T - a), R = nt * G;
                const int64_t kend = S - T + a + nt;  // keys [0, kend) of this block: up to its last query's
                const int64_t kpad = (kend + KB - 1) / KB * KB;
                for (int64_t r = 0; r < R; ++r) {  // row r: query a + r / G, head kk·G + r % G
                    const U* qr = q + ((b * T + a + r / G) * K * G + kk * G + r % G) * H;
                    if constexpr (BF16) {
                        widen(qr, qf.data() + r * H, H);
                        qrow[r] = qf.data() + r * H;
                    } else {
                        qrow[r] = qr;
                    }
                }
                // logits, tiles of QR rows x KB keys over the head dim
                for (int64_t r0 = 0; r0 < R; r0 += QR) {
                    const float* qr[QR];
                    for (int64_t i = 0; i < QR; ++i) qr[i] = qrow[std::min(r0 + i, R - 1)];
                    for (int64_t j0 = 0; j0 < kpad; j0 += KB) {
                        Vec acc[QR][2];
                        for (int64_t i = 0; i < QR; ++i) acc[i][0] = acc[i][1] = Vec(0.f);
                        const float* kd = kt.data() + j0;
                        for (int64_t d = 0; d < H; ++d, kd += Sp) {
                            const Vec k0 = Vec::loadu(kd), k1 = Vec::loadu(kd + W);
                            for (int64_t i = 0; i < QR; ++i) {
                                const Vec qi(qr[i][d]);
                                acc[i][0] = at::vec::fmadd(qi, k0, acc[i][0]);
                                acc[i][1] = at::vec::fmadd(qi, k1, acc[i][1]);
                            }
                        }
                        for (int64_t i = 0; i < QR && r0 + i < R; ++i)
                            store_logits(acc[i][0], acc[i][1], bias + (b * T + a + (r0 + i) / G) * S + j0,
                                         s.data() + (r0 + i) * Sp + j0, kend, j0, scale);
                    }
                }
                // max, exp, Σ per row
                for (int64_t r = 0; r < R; ++r) {
                    float* sr = s.data() + r * Sp;
                    inv[r] = exp_row(sr, kend);
                    if constexpr (BF16) {  // the weights e·(1/Σ) rounded to bf16 (to nearest even), before p·v
                        const Vec vi(inv[r]);
                        int64_t j = 0;
                        for (; j + W <= kend; j += W) round_bf16(Vec::loadu(sr + j) * vi).store(sr + j);
                        for (; j < kend; ++j) sr[j] = static_cast<float>(static_cast<U>(sr[j] * inv[r]));
                    }
                }
                // p·v, tiles of PR rows x PC vectors of the head dim, then the 1/Σ (float32) or a rounding to bf16
                for (int64_t r0 = 0; r0 < R; r0 += PR) {
                    const int64_t nr = std::min<int64_t>(PR, R - r0);
                    const float* pr[PR];
                    for (int64_t i = 0; i < PR; ++i) pr[i] = s.data() + std::min(r0 + i, R - 1) * Sp;
                    for (int64_t c0 = 0; c0 < J; c0 += PC) {
                        Vec acc[PR][PC];
                        for (int64_t i = 0; i < PR; ++i)
                            for (int64_t c = 0; c < PC; ++c) acc[i][c] = Vec(0.f);
                        for (int64_t j = 0; j < kend; ++j) {
                            Vec vr[PC];
                            for (int64_t c = 0; c < PC; ++c) vr[c] = Vec::loadu(vu + j * H + (c0 + c) * W);
                            for (int64_t i = 0; i < PR; ++i) {
                                const Vec p(pr[i][j]);
                                for (int64_t c = 0; c < PC; ++c) acc[i][c] = at::vec::fmadd(p, vr[c], acc[i][c]);
                            }
                        }
                        for (int64_t i = 0; i < nr; ++i) {
                            const int64_t r = r0 + i;
                            U* o = out + ((b * T + a + r / G) * K * G + kk * G + r % G) * H + c0 * W;
                            if constexpr (BF16) {
                                for (int64_t c = 0; c < PC; ++c) store_bf16(o + c * W, acc[i][c]);
                            } else {
                                const Vec f(inv[r]);
                                for (int64_t c = 0; c < PC; ++c) (acc[i][c] * f).store(o + c * W);
                            }
                        }
                    }
                }
            }
        }
    }
}

#if defined(CPU_CAPABILITY_AVX512) && (defined(__clang__) || __GNUC__ >= 11)
#define HAVE_DPBF16 1
// The bf16 build's arithmetic with the CPU's bf16 dot products (AVX512-BF16: each float32 lane adds a pair of exact
// bf16 products), for a caller that checked the CPU has them (dp): the logits sum q·k over pairs of the head dim,
// p·v over pairs of keys, each in float32 in another order than attend's; the softmax, the weights' rounding to bf16
// and the output's are attend's. A (row, kv head)'s keys are laid out once as pairs of the head dim, key-minor
// (kp[i·Sp + j] = k[j][2i], k[j][2i+1]), its values as pairs of keys (vp[i·H + d] = v[2i][d], v[2i+1][d]; a missing
// last key 0), the weights of each query row as bf16 with a 0 after an odd last key, so one 32-bit broadcast of a
// query's (or a weight row's) pair meets 16 keys (or 16 dims) in one instruction, twice attend's float32 multiply-adds.
__attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl")))
static void attend_dp(const c10::BFloat16* q, const c10::BFloat16* k, const c10::BFloat16* v, const float* bias,
                      c10::BFloat16* out, int64_t B, int64_t K, int64_t T, int64_t S, int64_t kv_b, int64_t kv_k,
                      float scale, int64_t qblock) {
    constexpr int64_t HP = H / 2, DQR = 8, DPR = 4;  // head-dim pairs; query rows of a logits and of a p·v tile
    const int64_t Sp = (S + KB - 1) / KB * KB, S2 = (S + 1) / 2, Wp = Sp + 2;
    const int64_t rows_max = qblock * G;
    // 16 bf16 values of key a (elements 0-15) and of key c (16-31) interleaved: a0 c0 a1 c1 ...
    alignas(64) int16_t pair_idx[32];
    for (int i = 0; i < 32; ++i) pair_idx[i] = static_cast<int16_t>((i & 1) * 16 + i / 2);
    const __m512i pairs = _mm512_load_si512(pair_idx);
    #pragma omp parallel
    {
        std::vector<float> kp(HP * Sp);              // the keys' head-dim pairs as 32-bit words, key-minor
        std::vector<uint32_t> vp(S2 * H);            // the values' key pairs as 32-bit words
        std::vector<float> s(rows_max * Sp);         // a block's logits, then its unnormalised weights
        std::vector<c10::BFloat16> pw(rows_max * Wp);  // a block's weights rounded to bf16
        #pragma omp for schedule(static)
        for (int64_t u = 0; u < B * K; ++u) {
            const int64_t b = u / K, kk = u % K;
            const c10::BFloat16* ku = k + b * kv_b + kk * kv_k;
            const c10::BFloat16* vu = v + b * kv_b + kk * kv_k;
            // a transpose of S x HP 32-bit words: moves only, so the float one carries the bf16 pairs unchanged
            at::vec::transpose_mxn<float>(reinterpret_cast<const float*>(ku), HP, kp.data(), Sp, S, HP);
            for (int64_t i = 0; i < HP; ++i)
                for (int64_t j = S; j < Sp; ++j) kp[i * Sp + j] = 0.f;
            for (int64_t i = 0; i < S2; ++i) {
                const c10::BFloat16* va = vu + 2 * i * H;
                for (int64_t d = 0; d < H; d += W) {
                    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(va + d));
                    const __m256i c = 2 * i + 1 < S ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(va + H + d))
                                                    : _mm256_setzero_si256();
                    const __m512i ac = _mm512_inserti64x4(_mm512_castsi256_si512(a), c, 1);
                    _mm512_storeu_si512(vp.data() + i * H + d, _mm512_permutexvar_epi16(pairs, ac));
                }
            }
            for (int64_t a = 0; a < T; a += qblock) {
                const int64_t nt = std::min<int64_t>(qblock, T - a), R = nt * G;
                const int64_t kend = S - T + a + nt;  // keys [0, kend) of this block: up to its last query's
                const int64_t kpad = (kend + KB - 1) / KB * KB, kpairs = (kend + 1) / 2;
                // logits, tiles of DQR rows x KB keys over the head-dim pairs
                for (int64_t r0 = 0; r0 < R; r0 += DQR) {
                    const uint32_t* qr[DQR];
                    for (int64_t i = 0; i < DQR; ++i) {
                        const int64_t r = std::min(r0 + i, R - 1);  // row r: query a + r / G, head kk·G + r % G
                        qr[i] = reinterpret_cast<const uint32_t*>(q + ((b * T + a + r / G) * K * G + kk * G + r % G) * H);
                    }
                    for (int64_t j0 = 0; j0 < kpad; j0 += KB) {
                        __m512 acc[DQR][2];
                        for (int64_t i = 0; i < DQR; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
                        const float* kd = kp.data() + j0;
                        for (int64_t i2 = 0; i2 < HP; ++i2, kd += Sp) {
                            const __m512bh k0 = (__m512bh)_mm512_castps_si512(_mm512_loadu_ps(kd));
                            const __m512bh k1 = (__m512bh)_mm512_castps_si512(_mm512_loadu_ps(kd + W));
                            for (int64_t i = 0; i < DQR; ++i) {
                                const __m512bh qi = (__m512bh)_mm512_set1_epi32(static_cast<int>(qr[i][i2]));
                                acc[i][0] = _mm512_dpbf16_ps(acc[i][0], qi, k0);
                                acc[i][1] = _mm512_dpbf16_ps(acc[i][1], qi, k1);
                            }
                        }
                        for (int64_t i = 0; i < DQR && r0 + i < R; ++i)
                            store_logits(Vec(acc[i][0]), Vec(acc[i][1]), bias + (b * T + a + (r0 + i) / G) * S + j0,
                                         s.data() + (r0 + i) * Sp + j0, kend, j0, scale);
                    }
                }
                // max, exp, Σ per row, then the weights e·(1/Σ) rounded to bf16 (attend's), a 0 after an odd kend
                for (int64_t r = 0; r < R; ++r) {
                    float* sr = s.data() + r * Sp;
                    c10::BFloat16* pr = pw.data() + r * Wp;
                    const float inv = exp_row(sr, kend);
                    const Vec vi(inv);
                    int64_t j = 0;
                    for (; j + W <= kend; j += W) store_bf16(pr + j, Vec::loadu(sr + j) * vi);
                    for (; j < kend; ++j) pr[j] = static_cast<c10::BFloat16>(sr[j] * inv);
                    if (kend % 2) pr[kend] = static_cast<c10::BFloat16>(0.f);
                }
                // p·v, tiles of DPR rows x the head dim over the key pairs, rounded once to bf16
                for (int64_t r0 = 0; r0 < R; r0 += DPR) {
                    const int64_t nr = std::min<int64_t>(DPR, R - r0);
                    const uint32_t* pr[DPR];
                    for (int64_t i = 0; i < DPR; ++i)
                        pr[i] = reinterpret_cast<const uint32_t*>(pw.data() + std::min(r0 + i, R - 1) * Wp);
                    __m512 acc[DPR][J];
                    for (int64_t i = 0; i < DPR; ++i)
                        for (int64_t c = 0; c < J; ++c) acc[i][c] = _mm512_setzero_ps();
                    for (int64_t i2 = 0; i2 < kpairs; ++i2) {
                        __m512bh vr[J];
                        for (int64_t c = 0; c < J; ++c)
                            vr[c] = (__m512bh)_mm512_loadu_si512(vp.data() + i2 * H + c * W);
                        for (int64_t i = 0; i < DPR; ++i) {
                            const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(pr[i][i2]));
                            for (int64_t c = 0; c < J; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], p, vr[c]);
                        }
                    }
                    for (int64_t i = 0; i < nr; ++i) {
                        const int64_t r = r0 + i;
                        c10::BFloat16* o = out + ((b * T + a + r / G) * K * G + kk * G + r % G) * H;
                        for (int64_t c = 0; c < J; ++c) store_bf16(o + c * W, Vec(acc[i][c]));
                    }
                }
            }
        }
    }
}
#endif

// dp: 1 where the caller found the CPU's bf16 dot products (bf16 builds only; ignored where the build has no
// AVX-512 code to hold them). A template, so that the float32 build never compiles the bf16 call.
template <class U>
static void run(const U* q, const U* k, const U* v, const float* bias, U* out, int64_t B, int64_t K, int64_t T,
                int64_t S, int64_t kv_b, int64_t kv_k, float scale, int64_t qblock, int64_t dp) {
#ifdef HAVE_DPBF16
    if constexpr (!std::is_same_v<U, float>) {
        if (dp) return attend_dp(q, k, v, bias, out, B, K, T, S, kv_b, kv_k, scale, qblock);
    }
#endif
    attend<U>(q, k, v, bias, out, B, K, T, S, kv_b, kv_k, scale, qblock);
}

extern "C" void kernel(const SCALAR* q, const SCALAR* k, const SCALAR* v, const float* bias, SCALAR* out, int64_t B,
                       int64_t K, int64_t T, int64_t S, int64_t kv_b, int64_t kv_k, float scale, int64_t qblock,
                       int64_t dp) {
    run<SCALAR>(q, k, v, bias, out, B, K, T, S, kv_b, kv_k, scale, qblock, dp);
}
