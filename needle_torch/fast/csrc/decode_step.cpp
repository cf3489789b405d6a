// A Needle 2 cached-decoding step on CPU (NEEDLE_V2.md §3, §6), one new token per row, as three kernels, one OpenMP
// parallel region for each layer or kernel: ENTRY 1 the lane layers, one after another (each: lane routing and
// Sinkhorn, the block's engram injection, gated q/k-normed attention over the K/V cache, the Hadamard MLP as a fast
// Walsh-Hadamard transform, the lane mix);
// ENTRY 2 every engram site's key and value for the newest token; ENTRY 3 the step's end (lane mean, final_norm,
// tied logits). The products split their blocks of weight rows evenly across the threads and stream each row once
// for all rows of the batch (bf16 inputs of 4 rows or more on AMX tiles where the CPU has them); the work between
// them runs row by row, the rows split across the threads (one thread at batch 1: tens of microseconds a layer),
// the lane routing's Sinkhorn a vector lane per row from 4 rows on. Built by needle_torch/cpu_decode.py through
// inductor's C++ toolchain with these defined in front: ENTRY, SCALAR (float or c10::BFloat16: weights, lanes and
// K/V cache), LANES, DMODEL, ATTN (attn dim), HEADS, KVHEADS, HEAD (head dim), HADA (Hadamard width, a power of two
// >= DMODEL), ENGRAM_ORDERS, ENGRAM_HEADS, ENGRAM_SLOTS, ENGRAM_SUB, ENGRAM_SITES.
//
// The arithmetic is the eager twin's (needle_torch/v2/model.py, lanes.py, engram.py) in the same order of
// operations, with every rounding to SCALAR where the eager bf16 twin rounds (r() and rv() below; the identity in
// float32): products and sums in float32, rounded once per output element; the float32 islands (lane routing,
// norm statistics, RoPE, softmax, the engram gate and its sum, the lane mix) in float32. It differs from eager only
// in the order of float32 sums (dot products, the Walsh transform's butterflies instead of a dense product, the
// softmax sum), in the lane routing's rms factor on bf16 lanes with the dot products (applied to the products' sums,
// not their inputs: lanes.route's compiled form), and, where the build has AVX512-BF16, in rounding float32
// subnormals to zero (bf16_lanes.h).
//
// Why: at batch 1 the compiled torch step spent its time between kernels (Python wrapper calls, a dozen parallel
// regions a layer with serial code between them); this is 3 calls a step, one region a layer.
#include <torch/csrc/inductor/cpp_prefix.h>
#include <cmath>
#include <initializer_list>
#include <utility>
#include <vector>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

using T = SCALAR;
using Vec = at::vec::Vectorized<float>;
constexpr int64_t N = LANES, D = DMODEL, A = ATTN, H = HEADS, K = KVHEADS, HD = HEAD, P = HADA;
constexpr int64_t G = H / K, KV = K * HD, ND = N * D, W = Vec::size();
static_assert(A == H * HD && H % K == 0, "attn dim = heads x head dim, heads a multiple of kv heads");
static_assert(D % W == 0 && A % W == 0 && HD % W == 0 && (P & (P - 1)) == 0 && P >= D, "vector-aligned widths");
constexpr float EPS = 1e-6f;
// How far ahead of its loads a projection asks for its weight rows (bytes): the hardware prefetcher stops at 4 KiB
// pages, and a decode step's projections are a stream of short rows. The attention's passes over the cached keys and
// values ask the same distance ahead.
constexpr int64_t PREFETCH = 2048;
// Products of few input vectors read their weight rows one after another, each thread one stream through its share,
// asking ROW_PREFETCH bytes ahead into L2 (prefetcht2): AMD's prefetchers follow one stream but not the 4 rows at
// once that the interleaved order reads, and a software prefetch into L1 slowed them. Past SEQ_VECTORS input vectors
// the interleaved order is faster again. The sums are the same either way (one float32 accumulator per output over
// the row in vector steps; ONE_ACCS of them for one input vector, in the sequential order only).
constexpr int64_t ROW_PREFETCH = 4096;
constexpr int64_t SEQ_VECTORS = 8;
// A product of one input vector sums each row into ONE_ACCS float32 accumulators, every ONE_ACCS-th vector step in
// each, then adds them: with one, each step waits for the last one's fused multiply-add (4 cycles on Zen 4), which
// bounds the bf16 upcast loads; two are enough to reach the memory bound.
constexpr int64_t ONE_ACCS = 2;

// the parameters' places in the pointer table (needle_torch/cpu_decode.py's TABLE, same order)
enum Slot {
    PHI_PRE, PHI_POST, PHI_RES, B_PRE, B_POST, B_RES, A_PRE, A_POST, A_RES, PRE_OFF, POST_OFF,
    PRE_ATTN, WQ, WK, WV, Q_NORM, K_NORM, WGATE, WOUT, POST_ATTN, ATTN_GATE, PRE_HADA, D1, D2, D3, KBUF, VBUF,
    SLOTS
};

static inline float r(float x) { return static_cast<float>(static_cast<T>(x)); }  // round to SCALAR
#include "bf16_lanes.h"
static inline float hsum(Vec v) { return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v); }
// round every lane to SCALAR (round_bf16); the identity in float32
static inline Vec rv(Vec v) {
    if constexpr (std::is_same_v<T, float>) return v;
    else return round_bf16(v);
}
static const Vec ONE(1.0f);
// sigmoid as the eager twin computes it: torch.sigmoid in float32; in bf16 1 / (1 + exp(-x)) rounded after each op
static inline Vec sigmoid(Vec x) { return rv(ONE / rv(ONE + rv(x.neg().exp()))); }
static inline float sigmoid(float x) {
    if constexpr (std::is_same_v<T, float>) return 1.0f / (1.0f + std::exp(-x));
    else return r(1.0f / r(1.0f + r(std::exp(-x))));
}

// A call's scratch: `n` elements of U carved from a buffer kept per calling thread (one per TAG) and grown on demand,
// never zeroed: every element a kernel reads, it has written first. Fresh std::vectors would be value-initialised and
// first touched on every call.
template <class U>
struct Scratch {
    U* p;
    U* data() const { return p; }
    U& operator[](int64_t i) const { return p[i]; }
};
template <class U, int TAG>
static U* arena(int64_t n) {
    thread_local std::vector<U> buf;
    if (int64_t(buf.size()) < n) buf.resize(n);
    return buf.data();
}
// point each of parts' buffers at its share of arena<U, TAG>, one after another
template <class U, int TAG>
static void carve(std::initializer_list<std::pair<Scratch<U>*, int64_t>> parts) {
    int64_t total = 0;
    for (const auto& part : parts) total += part.second;
    U* p = arena<U, TAG>(total);
    for (const auto& part : parts) part.first->p = p, p += part.second;
}

// One product of a step: weight rows w (rows, I) against nb input vectors x (nb, I) float32 (xh: the same as
// SCALAR, for the bf16 dot products; null: none), into y (nb, ystride) float32 sums. A projection is one or more
// of these, their rows split between the threads.
struct Seg {
    const T* w;
    int64_t rows;
    const float* x;
    const T* xh;
    int64_t nb, xstride;
    float* y;
    int64_t ystride;
};

// up to 4 rows of a Seg from row o, for every input vector: up to SEQ_VECTORS vectors row after row (each row read
// once for 4 vectors at a time, again from L1 for the next 4), else the 4 rows interleaved for each vector in turn
static void rows4(const Seg& sg, int64_t o, int64_t I) {
    const T* r0 = sg.w + o * I;
    const int64_t rows = sg.rows - o < 4 ? sg.rows - o : 4;
    if (sg.nb <= SEQ_VECTORS) {
        for (int64_t k = 0; k < rows; ++k) {
            const T* wk = r0 + k * I;
            if (sg.nb == 1) {  // ONE_ACCS accumulators along the row, then their sum
                Vec acc[ONE_ACCS];
                for (int64_t a = 0; a < ONE_ACCS; ++a) acc[a] = Vec(0);
                int64_t i = 0;
                for (; i + ONE_ACCS * W <= I; i += ONE_ACCS * W) {
                    for (int64_t a = 0; a < ONE_ACCS; ++a) {
                        if (((i + a * W) * int64_t(sizeof(T))) % 64 == 0)
                            _mm_prefetch(reinterpret_cast<const char*>(wk + i + a * W) + ROW_PREFETCH, _MM_HINT_T2);
                        acc[a] = at::vec::fmadd(load(wk + i + a * W), Vec::loadu(sg.x + i + a * W), acc[a]);
                    }
                }
                for (; i < I; i += W) acc[0] = at::vec::fmadd(load(wk + i), Vec::loadu(sg.x + i), acc[0]);
                for (int64_t a = 1; a < ONE_ACCS; ++a) acc[0] = acc[0] + acc[a];
                sg.y[o + k] = hsum(acc[0]);
                continue;
            }
            for (int64_t b0 = 0; b0 < sg.nb; b0 += 4) {
                const int64_t nv = sg.nb - b0 < 4 ? sg.nb - b0 : 4;
                Vec acc[4] = {Vec(0), Vec(0), Vec(0), Vec(0)};
                for (int64_t i = 0; i < I; i += W) {
                    if (b0 == 0 && (i * int64_t(sizeof(T))) % 64 == 0)
                        _mm_prefetch(reinterpret_cast<const char*>(wk + i) + ROW_PREFETCH, _MM_HINT_T2);
                    Vec wv = load(wk + i);
                    for (int64_t v = 0; v < nv; ++v)
                        acc[v] = at::vec::fmadd(wv, Vec::loadu(sg.x + (b0 + v) * sg.xstride + i), acc[v]);
                }
                for (int64_t v = 0; v < nv; ++v) sg.y[(b0 + v) * sg.ystride + o + k] = hsum(acc[v]);
            }
        }
        return;
    }
    for (int64_t b = 0; b < sg.nb; ++b) {
        const float* xb = sg.x + b * sg.xstride;
        float* yb = sg.y + b * sg.ystride + o;
        Vec acc[4] = {Vec(0), Vec(0), Vec(0), Vec(0)};
        for (int64_t i = 0; i < I; i += W) {
            Vec xv = Vec::loadu(xb + i);
            if (b == 0 && (i * int64_t(sizeof(T))) % 64 == 0)  // once per cache line of each row
                for (int64_t k = 0; k < rows; ++k)
                    _mm_prefetch(reinterpret_cast<const char*>(r0 + k * I + i) + PREFETCH, _MM_HINT_T0);
            for (int64_t k = 0; k < rows; ++k) acc[k] = at::vec::fmadd(load(r0 + k * I + i), xv, acc[k]);
        }
        for (int64_t k = 0; k < rows; ++k) yb[k] = hsum(acc[k]);
    }
}

#if defined(CPU_CAPABILITY_AVX512) && (defined(__clang__) || __GNUC__ >= 11)
#define HAVE_DPBF16 1
#include "bf16_dots.h"

// rows4 for bf16 weights and bf16-valued inputs with the CPU's bf16 dot products (AVX512-BF16: pairs of exact bf16
// products added into float32 lanes); the caller checks that the CPU has them and that I % 32 == 0. A block of 4
// rows takes its input vectors 4 at a time (block4_dp), the rest row after row (see ROW_PREFETCH); each sum is the
// same in either form; the blocks read each input vector once for 4 rows.
__attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl")))
static void rows4_dp(const c10::BFloat16* w, int64_t rows, const c10::BFloat16* xh, int64_t nb, int64_t xstride,
                     float* y, int64_t ystride, int64_t I) {
    int64_t blocked = 0;
    if (rows == 4)
        for (; blocked + 4 <= nb; blocked += 4)
            block4_dp<4>(w, xh + blocked * xstride, xstride, y + blocked * ystride, ystride, I,
                         blocked == 0 ? ROW_PREFETCH : 0);
    for (int64_t k = 0; k < rows; ++k) {  // row after row, at any number of vectors (see ROW_PREFETCH)
        const c10::BFloat16* wk = w + k * I;
        for (int64_t b0 = blocked; b0 < nb; b0 += 4) {
            const int64_t nv = nb - b0 < 4 ? nb - b0 : 4;
            __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
            for (int64_t i = 0; i < I; i += 32) {
                if (b0 == 0) _mm_prefetch(reinterpret_cast<const char*>(wk + i) + ROW_PREFETCH, _MM_HINT_T2);
                __m512bh wv = (__m512bh)_mm512_loadu_si512(wk + i);
                for (int64_t v = 0; v < nv; ++v)
                    acc[v] = _mm512_dpbf16_ps(acc[v], wv, (__m512bh)_mm512_loadu_si512(xh + (b0 + v) * xstride + i));
            }
            for (int64_t v = 0; v < nv; ++v) y[(b0 + v) * ystride + k] = _mm512_reduce_add_ps(acc[v]);
        }
    }
}

// Blocks of 16 weight rows on the CPU's AMX tiles, for products of many input vectors (dp == 2, nb >= AMX_ROWS): a
// tile of 16 weight rows x 32 elements, read in the weights' own layout, against a tile of 16 input vectors whose
// element pairs the caller has laid out as 32-bit words (I/2, nbp) ("VNNI"), into 16 x 16 float32 sums; the same
// pairs of exact bf16 products in float32 as rows4_dp, summed in another order. Below AMX_ROWS vectors rows4_dp is
// faster.
constexpr int64_t AMX_ROWS = 4;
constexpr int CTILES = 4;  // float32 sum tiles per pass over a block (tiles 2..5; 0: weights, 1: inputs)
struct TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};
// Linux hands out AMX's tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), once a
// process; refused, the products keep rows4_dp.
static bool amx_permitted() {
#if defined(__linux__) && defined(SYS_arch_prctl)
    static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return ok;
#else
    return false;
#endif
}
__attribute__((target("amx-tile,amx-bf16")))
static void amx_begin() {
    TileConfig c{};
    c.palette = 1;
    for (int t = 0; t < 2 + CTILES; ++t) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}
__attribute__((target("amx-tile"))) static void amx_end() { _tile_release(); }
// rows 16 weight rows from w (stride I) against the word pairs vn (I/2, nbp) of nb vectors, into y (nb, ystride)
__attribute__((target("amx-tile,amx-bf16")))
static void rows16_amx(const c10::BFloat16* w, const uint32_t* vn, int64_t nb, int64_t nbp, float* y, int64_t ystride,
                       int64_t I) {
    alignas(64) float c[CTILES][16][16];
    for (int64_t t0 = 0; t0 < nbp / 16; t0 += CTILES) {
        const int64_t nt = nbp / 16 - t0 < CTILES ? nbp / 16 - t0 : CTILES;
        _tile_zero(2);
        _tile_zero(3);
        _tile_zero(4);
        _tile_zero(5);
        for (int64_t i = 0; i < I; i += 32) {
            if (t0 == 0)
                for (int64_t k = 0; k < 16; ++k)
                    _mm_prefetch(reinterpret_cast<const char*>(w + k * I + i) + PREFETCH, _MM_HINT_T0);
            _tile_loadd(0, w + i, I * 2);
            const uint32_t* v = vn + (i / 2) * nbp + t0 * 16;
            _tile_loadd(1, v, nbp * 4);
            _tile_dpbf16ps(2, 0, 1);
            if (nt > 1) {
                _tile_loadd(1, v + 16, nbp * 4);
                _tile_dpbf16ps(3, 0, 1);
            }
            if (nt > 2) {
                _tile_loadd(1, v + 32, nbp * 4);
                _tile_dpbf16ps(4, 0, 1);
            }
            if (nt > 3) {
                _tile_loadd(1, v + 48, nbp * 4);
                _tile_dpbf16ps(5, 0, 1);
            }
        }
        _tile_stored(2, c[0], 64);
        if (nt > 1) _tile_stored(3, c[1], 64);
        if (nt > 2) _tile_stored(4, c[2], 64);
        if (nt > 3) _tile_stored(5, c[3], 64);
        for (int64_t t = 0; t < nt; ++t)
            for (int64_t n = 0; n < 16 && (t0 + t) * 16 + n < nb; ++n)
                for (int64_t m = 0; m < 16; ++m) y[((t0 + t) * 16 + n) * ystride + m] = c[t][m][n];
    }
}
#endif

constexpr int64_t MAX_SEGS = 8;  // the most Segs one project() call takes
// Scratch for the AMX tiles' input layout: (I/2, nbp) words per product input, nbp = nb rounded up to 16.
static int64_t vnni_words(int64_t nb, int64_t I) { return (nb + 15) / 16 * 16 * (I / 2); }

// The products of segs[0..n) (one input width I) as one worksharing loop over their blocks of weight rows (16 on
// AMX tiles, else 4), split evenly across the threads (one barrier, at the end). dp: 1 the bf16 dot products, 2
// AMX tiles too (for the Segs of AMX_ROWS vectors or more), for the Segs that have xh; vnni: scratch for the tiles'
// input layout, vnni_words(nb, I) words for each Seg that takes them.
static void project(const Seg* segs, int64_t n, int64_t I, int64_t dp, uint32_t* vnni = nullptr) {
    bool tiles[MAX_SEGS] = {}, lays[MAX_SEGS] = {};  // whether Seg k runs on AMX tiles, whether it lays out its input
    uint32_t* vn[MAX_SEGS] = {};
    int64_t blocks[MAX_SEGS] = {};  // Seg k's blocks of weight rows
    int64_t total = 0, offset = 0;
    bool any = false;
    for (int64_t k = 0; k < n; ++k) {
#ifdef HAVE_DPBF16
        if constexpr (!std::is_same_v<T, float>) {
            const Seg& sg = segs[k];
            tiles[k] = dp == 2 && vnni != nullptr && sg.xh != nullptr && sg.nb >= AMX_ROWS && sg.rows % 16 == 0 &&
                       I % 32 == 0 && amx_permitted();
            if (tiles[k]) {
                int64_t same = 0;  // Segs of one input share its layout
                while (same < k && !(tiles[same] && segs[same].xh == sg.xh && segs[same].nb == sg.nb &&
                                     segs[same].xstride == sg.xstride)) ++same;
                lays[k] = same == k;
                vn[k] = lays[k] ? vnni + offset : vn[same];
                if (lays[k]) offset += vnni_words(sg.nb, I);
                any = true;
            }
        }
#endif
        blocks[k] = tiles[k] ? segs[k].rows / 16 : (segs[k].rows + 3) / 4;
        total += blocks[k];
    }
#ifdef HAVE_DPBF16
    if (any) {
        #pragma omp for schedule(static)
        for (int64_t k = 0; k < n; ++k)  // lay out each input once: vn[j][b] = the j-th element pair of vector b
            if (lays[k]) {
                const Seg& sg = segs[k];
                const int64_t nbp = (sg.nb + 15) / 16 * 16;
                for (int64_t j = 0; j < I / 2; ++j)
                    for (int64_t b = 0; b < nbp; ++b)
                        vn[k][j * nbp + b] = b < sg.nb ? reinterpret_cast<const uint32_t*>(sg.xh + b * sg.xstride)[j] : 0u;
            }
        amx_begin();
    }
#endif
    #pragma omp for schedule(static)
    for (int64_t blk = 0; blk < total; ++blk) {
        int64_t k = 0, o = blk;
        while (o >= blocks[k]) o -= blocks[k], ++k;
        const Seg& sg = segs[k];
#ifdef HAVE_DPBF16
        if constexpr (!std::is_same_v<T, float>) {  // (the casts only name the type T already is here)
            if (tiles[k]) {
                rows16_amx(reinterpret_cast<const c10::BFloat16*>(sg.w + 16 * o * I), vn[k], sg.nb,
                           (sg.nb + 15) / 16 * 16, sg.y + 16 * o, sg.ystride, I);
                continue;
            }
            if (dp && sg.xh != nullptr && I % 32 == 0) {
                const int64_t rows = sg.rows - 4 * o < 4 ? sg.rows - 4 * o : 4;
                rows4_dp(reinterpret_cast<const c10::BFloat16*>(sg.w + 4 * o * I), rows,
                         reinterpret_cast<const c10::BFloat16*>(sg.xh), sg.nb, sg.xstride, sg.y + 4 * o, sg.ystride,
                         I);
                continue;
            }
        }
#endif
        rows4(sg, 4 * o, I);
    }
#ifdef HAVE_DPBF16
    if (any) amx_end();
#endif
}

template <class U>  // float or SCALAR (widened exactly)
static inline float sum_squares(const U* x, int64_t n) {
    Vec acc(0);
    for (int64_t i = 0; i < n; i += W) acc = at::vec::fmadd(load(x + i), load(x + i), acc);
    return hsum(acc);
}

// ZCRMSNorm: r(r(r(1 + scale) · x) / sqrt(mean(x²) + eps)), statistics in float32; x already SCALAR-valued
static void zc_norm(const float* x, const T* scale, float* out, int64_t n) {
    Vec rms(std::sqrt(sum_squares(x, n) / n + EPS));
    for (int64_t i = 0; i < n; i += W) store(out + i, rv(rv(rv(ONE + load(scale + i)) * Vec::loadu(x + i)) / rms));
}

#include "walsh.h"

#if ENTRY == 1
// Sinkhorn over the lane routing logits z = a·R + b (N x N) of `rows` rows (R at stride rstride), 20 log-space steps
// (rows, then columns), hres = exp(z) (N x N per row). From SINKHORN_LANES rows on, up to W rows at a time, one per
// vector lane (V = Vec); below, one row in scalar code (V = float), whose exp and log cost less than the vector ones
// for a single row.
constexpr int64_t SINKHORN_LANES = 4;
static inline float maximum(float a, float b) { return std::max(a, b); }
static inline Vec maximum(Vec a, Vec b) { return at::vec::maximum(a, b); }
static inline float exp_(float x) { return std::exp(x); }
static inline Vec exp_(Vec x) { return x.exp(); }
static inline float log_(float x) { return std::log(x); }
static inline Vec log_(Vec x) { return x.log(); }
template <class V>
static void sinkhorn_steps(V (&zz)[N][N]) {
    for (int it = 0; it < 20; ++it) {
        for (int64_t i = 0; i < N; ++i) {  // rows (the last axis)
            V m = zz[i][0], t(0);
            for (int64_t j = 1; j < N; ++j) m = maximum(m, zz[i][j]);
            for (int64_t j = 0; j < N; ++j) t = t + exp_(zz[i][j] - m);
            V lse = m + log_(t);
            for (int64_t j = 0; j < N; ++j) zz[i][j] = zz[i][j] - lse;
        }
        for (int64_t j = 0; j < N; ++j) {  // columns
            V m = zz[0][j], t(0);
            for (int64_t i = 1; i < N; ++i) m = maximum(m, zz[i][j]);
            for (int64_t i = 0; i < N; ++i) t = t + exp_(zz[i][j] - m);
            V lse = m + log_(t);
            for (int64_t i = 0; i < N; ++i) zz[i][j] = zz[i][j] - lse;
        }
    }
}
static void sinkhorn_rows(const float* logits, int64_t rstride, int64_t rows, float a, const T* bias, float* hres) {
    if (rows == 1) {
        float zz[N][N];
        for (int64_t i = 0; i < N; ++i)
            for (int64_t j = 0; j < N; ++j) zz[i][j] = a * logits[i * N + j] + float(bias[i * N + j]);
        sinkhorn_steps(zz);
        for (int64_t i = 0; i < N; ++i)
            for (int64_t j = 0; j < N; ++j) hres[i * N + j] = std::exp(zz[i][j]);
        return;
    }
    alignas(64) float zt[N * N][W] = {};
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t ij = 0; ij < N * N; ++ij) zt[ij][r] = a * logits[r * rstride + ij] + float(bias[ij]);
    Vec zz[N][N];
    for (int64_t i = 0; i < N; ++i)
        for (int64_t j = 0; j < N; ++j) zz[i][j] = Vec::loadu(zt[i * N + j]);
    sinkhorn_steps(zz);
    for (int64_t ij = 0; ij < N * N; ++ij) zz[ij / N][ij % N].exp().store(zt[ij]);
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t ij = 0; ij < N * N; ++ij) hres[r * N * N + ij] = zt[ij][r];
}

// ---------------------------------------------------------------------------------------------- one lane layer
// lanes (B, N, D) SCALAR -> out (B, N, D); table: the layer's parameter pointers (Slot order); mask (B, S) over the
// keys 0..S-1 (S = pos + 1); cos, sin (HD/2) float32 at pos; ek (B, D) float32 rms_unit(engram key) and ev (B, D)
// SCALAR, both null where the layer has no engram site; the cache buffers (B, K, M, HD) in the table; walsh_entry =
// cast(1/sqrt(P)); dp: use the CPU's bf16 dot products (bf16 only; the caller checks the CPU has them).
static void one_layer(const int64_t* table, const T* lanes, T* out, const bool* mask, const float* cos,
                      const float* sin, const float* ek, const T* ev, int64_t B, int64_t pos, int64_t M,
                      float walsh_entry, float masked, int64_t dp) {
    auto ptr = [&](Slot s) { return reinterpret_cast<const T*>(table[s]); };
    const int64_t S = pos + 1, R = 2 * N + N * N, QKVG = 2 * A + 2 * KV;
    const float scale = 1.0f / std::sqrt(float(HD));
    // per-row float32 scratch, each holding SCALAR-rounded values where the eager twin holds SCALAR tensors;
    // xnh, atth: the inputs of the bf16 dot products as bf16
    Scratch<float> xhat, rms, proj, hpre, hpost, hres, u, x, xn, qkvg, att, o, z, s;
    Scratch<T> xnh, atth;
    Scratch<uint32_t> vnni;
    carve<float, 0>({{&xhat, B * ND}, {&rms, B}, {&proj, B * R}, {&hpre, B * N}, {&hpost, B * N}, {&hres, B * N * N},
                     {&u, B * D}, {&x, B * D}, {&xn, B * D}, {&qkvg, B * QKVG}, {&att, B * A}, {&o, B * D}, {&z, B * P},
                     {&s, B * H * S}});
    carve<T, 1>({{&xnh, B * D}, {&atth, B * A}});
    carve<uint32_t, 2>({{&vnni, std::max(vnni_words(B, D), vnni_words(B, A))}});
    // x̂ φᵀ for φ_pre, φ_post, φ_res into proj; q, gate, k, v (in that order) into qkvg; out_proj into o
    // bf16 lanes on the bf16 dot products (dp, ND a whole number of 32-element steps): x φᵀ of the lanes themselves,
    // each row's sums then times rms_unit's factor (x̂ is never written): faster than float32 products of x̂.
    const bool lane_dp = !std::is_same_v<T, float> && dp && ND % 32 == 0;
    const T* lx = lane_dp ? lanes : nullptr;
    const Seg phi[3] = {{ptr(PHI_PRE), N, xhat.data(), lx, B, ND, proj.data(), R},
                        {ptr(PHI_POST), N, xhat.data(), lx, B, ND, proj.data() + N, R},
                        {ptr(PHI_RES), N * N, xhat.data(), lx, B, ND, proj.data() + 2 * N, R}};
    const Seg qgkv[4] = {{ptr(WQ), A, xn.data(), xnh.data(), B, D, qkvg.data(), QKVG},
                         {ptr(WGATE), A, xn.data(), xnh.data(), B, D, qkvg.data() + A, QKVG},
                         {ptr(WK), KV, xn.data(), xnh.data(), B, D, qkvg.data() + 2 * A, QKVG},
                         {ptr(WV), KV, xn.data(), xnh.data(), B, D, qkvg.data() + 2 * A + KV, QKVG}};
    const Seg out_proj = {ptr(WOUT), D, att.data(), atth.data(), B, A, o.data(), D};
    #pragma omp parallel
    {
        // ---- lane routing inputs: x̂ = rms_unit(lanes flattened), then x̂ φᵀ for φ_pre, φ_post, φ_res (lane_dp:
        // rms_unit's factor alone, then (x φᵀ)·factor)
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < B; ++b) {
            const T* l = lanes + b * ND;
            rms[b] = 1.0f / std::sqrt(sum_squares(l, ND) / ND + EPS);
            if (lane_dp) continue;
            float* xh = xhat.data() + b * ND;
            for (int64_t i = 0; i < ND; i += W) (load(l + i) * Vec(rms[b])).store(xh + i);
        }
        project(phi, 3, ND, lane_dp ? 1 : 0);  // (no AMX tiles: their scratch is sized for D-wide inputs)
        if (lane_dp) {
            #pragma omp for schedule(static)
            for (int64_t b = 0; b < B; ++b)
                for (int64_t j = 0; j < R; ++j) proj[b * R + j] *= rms[b];
        }
        // ---- hres = Sinkhorn(a_res·(x̂ φ_res) + b_res) (see sinkhorn_rows)
        #pragma omp for schedule(static)
        for (int64_t b0 = 0; b0 < B; b0 += B < SINKHORN_LANES ? 1 : W) {
            const int64_t rows = B < SINKHORN_LANES ? 1 : std::min(W, B - b0);
            sinkhorn_rows(proj.data() + b0 * R + 2 * N, R, rows, float(*ptr(A_RES)), ptr(B_RES),
                          hres.data() + b0 * N * N);
        }
        // ---- routing weights, u = read_lanes, the engram injection, pre_attn_norm
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < B; ++b) {
            const float* p = proj.data() + b * R;
            const float* pre_off = reinterpret_cast<const float*>(table[PRE_OFF]);
            const float* post_off = reinterpret_cast<const float*>(table[POST_OFF]);
            float a_pre = float(*ptr(A_PRE)), a_post = float(*ptr(A_POST));
            for (int64_t i = 0; i < N; ++i) {
                hpre[b * N + i] = 1.0f / (1.0f + std::exp(-(a_pre * p[i] + float(ptr(B_PRE)[i]) + pre_off[i])));
                hpost[b * N + i] = 2.0f / (1.0f + std::exp(-(a_post * p[N + i] + float(ptr(B_POST)[i]) + post_off[i])));
            }
            const T* l = lanes + b * ND;
            float* ub = u.data() + b * D;
            float* xb = x.data() + b * D;
            for (int64_t d = 0; d < D; d += W) {
                Vec t(0);
                for (int64_t i = 0; i < N; ++i) t = t + Vec(hpre[b * N + i]) * load(l + i * D + d);
                rv(t).store(ub + d), rv(t).store(xb + d);
            }
            if (ek != nullptr) {  // x = u + r(α · f32(ev)), α = σ(⟨rms_unit(u), rms_unit(ek)⟩ / √D)
                float inv = 1.0f / std::sqrt(sum_squares(ub, D) / D + EPS);
                Vec dot(0);
                for (int64_t d = 0; d < D; d += W) dot = at::vec::fmadd(Vec::loadu(ub + d) * Vec(inv), Vec::loadu(ek + b * D + d), dot);
                Vec alpha(1.0f / (1.0f + std::exp(-(hsum(dot) / std::sqrt(float(D))))));
                for (int64_t d = 0; d < D; d += W)
                    rv(Vec::loadu(ub + d) + rv(alpha * load(ev + b * D + d))).store(xb + d);
            }
            zc_norm(xb, ptr(PRE_ATTN), xn.data() + b * D, D);
            for (int64_t d = 0; d < D; d += W) store(xnh.data() + b * D + d, Vec::loadu(xn.data() + b * D + d));
        }
        // ---- q, gate, k, v: one pass over their weight rows
        project(qgkv, 4, D, dp, vnni.data());
        // ---- per head: round the products, q/k norms, RoPE (float32 tables), K/V into the cache at pos
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < B; ++b) {
            float* q = qkvg.data() + b * QKVG;
            for (int64_t i = 0; i < QKVG; i += W) rv(Vec::loadu(q + i)).store(q + i);
            float tmp[HD];
            for (int64_t hh = 0; hh < H + K; ++hh) {  // query heads, then kv heads (k follows gate)
                float* v = hh < H ? q + hh * HD : q + 2 * A + (hh - H) * HD;
                zc_norm(v, ptr(hh < H ? Q_NORM : K_NORM), tmp, HD);
                // RoPE on vectors of the two halves: the same operations lane by lane as one pair at a time, faster.
                if constexpr ((HD / 2) % W == 0) {
                    for (int64_t i = 0; i < HD / 2; i += W) {
                        const Vec x1 = Vec::loadu(tmp + i), x2 = Vec::loadu(tmp + i + HD / 2);
                        const Vec c = Vec::loadu(cos + i), sn = Vec::loadu(sin + i);
                        rv(x1 * c - x2 * sn).store(v + i);
                        rv(x2 * c + x1 * sn).store(v + i + HD / 2);
                    }
                } else {  // half a head less than a vector
                    for (int64_t i = 0; i < HD / 2; ++i) {
                        float x1 = tmp[i], x2 = tmp[i + HD / 2];
                        v[i] = r(x1 * cos[i] - x2 * sin[i]);
                        v[i + HD / 2] = r(x2 * cos[i] + x1 * sin[i]);
                    }
                }
            }
            T* kb = const_cast<T*>(ptr(KBUF)) + (b * K * M + pos) * HD;
            T* vb = const_cast<T*>(ptr(VBUF)) + (b * K * M + pos) * HD;
            for (int64_t kh = 0; kh < K; ++kh)
                for (int64_t i = 0; i < HD; i += W) {
                    store(kb + kh * M * HD + i, Vec::loadu(q + 2 * A + kh * HD + i));
                    store(vb + kh * M * HD + i, Vec::loadu(q + 2 * A + KV + kh * HD + i));
                }
        }
        // ---- attention over the cache, one (row, kv head) per iteration: flash arithmetic (cpu_attention's); the
        // weighted sum reads each value row once for the kv head's G query heads, not once per query head.
        #pragma omp for schedule(static)
        for (int64_t unit = 0; unit < B * K; ++unit) {
            const int64_t b = unit / K, kh = unit % K;
            const T* kc = ptr(KBUF) + (b * K + kh) * M * HD;
            const T* vc = ptr(VBUF) + (b * K + kh) * M * HD;
            const bool* mk = mask + b * S;
            const float* q = qkvg.data() + b * QKVG + kh * G * HD;
            float* sg = s.data() + (b * H + kh * G) * S;
            float mx[G];
            for (int64_t g = 0; g < G; ++g) mx[g] = masked;
            for (int64_t m = 0; m < S; ++m) {
                if (!mk[m]) {
                    for (int64_t g = 0; g < G; ++g) sg[g * S + m] = masked;
                    continue;
                }
                Vec kr[HD / W];
                for (int64_t o = 0; o < HD * int64_t(sizeof(T)); o += 64)  // (the next units' rows: see PREFETCH)
                    _mm_prefetch(reinterpret_cast<const char*>(kc + m * HD) + o + PREFETCH, _MM_HINT_T0);
                for (int64_t j = 0; j < HD / W; ++j) kr[j] = load(kc + m * HD + j * W);
                for (int64_t g = 0; g < G; ++g) {
                    Vec acc = Vec::loadu(q + g * HD) * kr[0];
                    for (int64_t j = 1; j < HD / W; ++j) acc = at::vec::fmadd(Vec::loadu(q + g * HD + j * W), kr[j], acc);
                    float d = hsum(acc) * scale;
                    sg[g * S + m] = d;
                    mx[g] = std::max(mx[g], d);
                }
            }
            for (int64_t g = 0; g < G; ++g) {  // softmax over the keys, rounded to SCALAR as eager's weights
                float* sp = sg + g * S;
                Vec mv(mx[g]), tv(0);
                int64_t m = 0;
                for (; m + W <= S; m += W) {
                    Vec e = (Vec::loadu(sp + m) - mv).exp();
                    e.store(sp + m);
                    tv = tv + e;
                }
                float t = hsum(tv);
                for (; m < S; ++m) t += (sp[m] = std::exp(sp[m] - mx[g]));
                Vec inv_t(t);
                for (m = 0; m + W <= S; m += W) rv(Vec::loadu(sp + m) / inv_t).store(sp + m);
                for (; m < S; ++m) sp[m] = r(sp[m] / t);
            }
            Vec acc[G][HD / W];  // Σ_m p[g][m] · V[m], each value row read once for the G heads that share it
            for (int64_t g = 0; g < G; ++g)
                for (int64_t j = 0; j < HD / W; ++j) acc[g][j] = Vec(0);
            for (int64_t m = 0; m < S; ++m) {
                for (int64_t o = 0; o < HD * int64_t(sizeof(T)); o += 64)
                    _mm_prefetch(reinterpret_cast<const char*>(vc + m * HD) + o + PREFETCH, _MM_HINT_T0);
                Vec vr[HD / W];
                for (int64_t j = 0; j < HD / W; ++j) vr[j] = load(vc + m * HD + j * W);
                for (int64_t g = 0; g < G; ++g) {
                    const float pm = sg[g * S + m];
                    if (pm == 0) continue;  // exactly zero weight (masked keys): adds nothing
                    for (int64_t j = 0; j < HD / W; ++j) acc[g][j] = at::vec::fmadd(Vec(pm), vr[j], acc[g][j]);
                }
            }
            for (int64_t g = 0; g < G; ++g) {
                float* ob = att.data() + b * A + (kh * G + g) * HD;
                for (int64_t j = 0; j < HD / W; ++j) rv(acc[g][j]).store(ob + j * W);
            }
        }
        // ---- the sigmoid output gate
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < B; ++b)
            for (int64_t i = 0; i < A; i += W) {
                Vec v = rv(Vec::loadu(att.data() + b * A + i) * sigmoid(Vec::loadu(qkvg.data() + b * QKVG + A + i)));
                v.store(att.data() + b * A + i);
                store(atth.data() + b * A + i, v);
            }
        project(&out_proj, 1, A, dp, vnni.data());
        // ---- x += σ(attn_gate)·post_attn_norm(o); the Hadamard MLP; y = block - u; the lane mix
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < B; ++b) {
            float* ob = o.data() + b * D;
            float* xb = x.data() + b * D;
            float* nb = xn.data() + b * D;
            float* zb = z.data() + b * P;
            for (int64_t d = 0; d < D; d += W) rv(Vec::loadu(ob + d)).store(ob + d);
            zc_norm(ob, ptr(POST_ATTN), nb, D);
            Vec g(r(sigmoid(float(*ptr(ATTN_GATE)))));
            for (int64_t d = 0; d < D; d += W) rv(Vec::loadu(xb + d) + rv(g * Vec::loadu(nb + d))).store(xb + d);
            zc_norm(xb, ptr(PRE_HADA), nb, D);
            for (int64_t i = 0; i < P; i += W) (i < D ? rv(load(ptr(D1) + i) * Vec::loadu(nb + i)) : Vec(0)).store(zb + i);
            walsh(zb, walsh_entry);
            for (int64_t i = 0; i < P; i += W) {
                Vec v = rv(load(ptr(D2) + i) * Vec::loadu(zb + i));
                rv(v * sigmoid(v)).store(zb + i);
            }
            walsh(zb, walsh_entry);
            const T* l = lanes + b * ND;
            T* ol = out + b * ND;
            for (int64_t d = 0; d < D; d += W) {
                Vec y = rv(rv(Vec::loadu(xb + d) + rv(load(ptr(D3) + d) * Vec::loadu(zb + d))) - Vec::loadu(u.data() + b * D + d));
                for (int64_t i = 0; i < N; ++i) {
                    Vec t(0);
                    for (int64_t j = 0; j < N; ++j) t = t + Vec(hres[(b * N + i) * N + j]) * load(l + j * D + d);
                    store(ol + i * D + d, rv(t + Vec(hpost[b * N + i]) * y));
                }
            }
        }
    }
}

// The step's lane layers, one after another in one call: tables (layers, SLOTS) their parameter pointers; x (B, N, D)
// the first layer's lanes, then x and y each layer's input and output in turn (the last layer's output is y for an
// odd count, x for an even one); site[i] the engram site layer i injects (-1: none), ek (G, B, D) float32 and ev
// (G, B, D) SCALAR every site's; the rest as one_layer's. One call rather than one from Python per layer: no
// Python between layers.
extern "C" void kernel(const int64_t* tables, int64_t layers, T* x, T* y, const bool* mask, const float* cos,
                       const float* sin, const float* ek, const T* ev, const int64_t* site, int64_t B, int64_t pos,
                       int64_t M, float walsh_entry, float masked, int64_t dp) {
    for (int64_t i = 0; i < layers; ++i) {
        const int64_t g = site[i];
        one_layer(tables + i * SLOTS, x, y, mask, cos, sin, g < 0 ? nullptr : ek + g * B * D,
                  g < 0 ? nullptr : ev + g * B * D, B, pos, M, walsh_entry, masked, dp);
        std::swap(x, y);
    }
}

#elif ENTRY == 2
// ---------------------------------------------------------------------------------------------- the engram sites
// Every site's engram key and value for the newest token of each row (model.Engram.forward with last=1, as
// decode_step reads it: the n-grams and taps of the history window alone, validity from hist_valid). ENGRAM_ORDERS
// (the orders, comma-separated), ENGRAM_HEADS E, ENGRAM_SLOTS S, ENGRAM_SUB s, SITES G; N = |O|·E tables, table
// k = oi·E + e (order-major). Hash: acc = SEED·(k+1); acc = (acc XOR u[t-j])·PRIME for j < o (u = 0 before the
// window); acc ^= acc >> 15; row = acc mod S; all mod 2^32 (upstream's engram_indices).
constexpr int64_t ORDERS[] = {ENGRAM_ORDERS};
constexpr int64_t NO = sizeof(ORDERS) / sizeof(ORDERS[0]), E = ENGRAM_HEADS, SL = ENGRAM_SLOTS, SUB = ENGRAM_SUB;
constexpr int64_t NT = NO * E, NS = NT * SUB, SITES = ENGRAM_SITES, TAPS = 4;
static_assert(2 * SITES <= MAX_SEGS, "one project() call takes every site's key and value products");
constexpr int64_t DIL = [] { int64_t m = 0; for (int64_t o : ORDERS) m = o > m ? o : m; return m; }();
constexpr int64_t HW = TAPS * DIL + 1;  // the history window: W = 4·max(O) tokens before the newest, and it
static_assert(NS % W == 0, "engram width N·s a multiple of the vector width");

// table: per site (embedding (N, S, s), key_proj (D, N·s), value_proj (D, N·s), taps (4, D)); hist (B, HW) int64 and
// hv (B, HW) bool: the window's tokens and validity, newest last; out: ek (G, B, D) float32 rms_unit(key), ev (G, B,
// D) SCALAR the tapped value.
extern "C" void kernel(const int64_t* table, const int64_t* hist, const bool* hv, float* ek, T* ev, int64_t B,
                       int64_t dp) {
    // the value rows the taps read: t - j·dil for j < 4 (t = HW - 1, the newest; j = 0 is also the key's row)
    Scratch<float> e, key, val;
    Scratch<T> eh;
    Scratch<uint32_t> vnni;
    carve<float, 0>({{&e, SITES * B * TAPS * NS}, {&key, SITES * B * D}, {&val, SITES * B * TAPS * D}});
    carve<T, 1>({{&eh, SITES * B * TAPS * NS}});
    carve<uint32_t, 2>({{&vnni, SITES * (vnni_words(B, NS) + vnni_words(B * TAPS, NS))}});
    std::vector<Seg> segs;
    for (int64_t g = 0; g < SITES; ++g) {
        const T* key_proj = reinterpret_cast<const T*>(table[4 * g + 1]);
        const T* value_proj = reinterpret_cast<const T*>(table[4 * g + 2]);
        const float* eg = e.data() + g * B * TAPS * NS;
        const T* egh = eh.data() + g * B * TAPS * NS;
        segs.push_back({key_proj, D, eg, egh, B, TAPS * NS, key.data() + g * B * D, D});
        segs.push_back({value_proj, D, eg, egh, B * TAPS, NS, val.data() + g * B * TAPS * D, D});
    }
    #pragma omp parallel
    {
        #pragma omp for collapse(2) schedule(static)
        for (int64_t g = 0; g < SITES; ++g)
            for (int64_t b = 0; b < B; ++b)
                for (int64_t j = 0; j < TAPS; ++j) {
                    const T* emb = reinterpret_cast<const T*>(table[4 * g]);
                    const int64_t t = HW - 1 - j * DIL;
                    const int64_t* u = hist + b * HW;
                    float* ej = e.data() + ((g * B + b) * TAPS + j) * NS;
                    for (int64_t k = 0; k < NT; ++k) {
                        const int64_t order = ORDERS[k / E];
                        uint32_t acc = uint32_t(0x9E3779B9u) * uint32_t(k + 1);
                        for (int64_t back = 0; back < order; ++back)
                            acc = (acc ^ (t - back >= 0 ? uint32_t(u[t - back]) : 0u)) * uint32_t(0x01000193u);
                        acc ^= acc >> 15;
                        const bool ok = t - (order - 1) >= 0 && hv[b * HW + t - (order - 1)];  // ngram_ok
                        const T* row = emb + (k * SL + int64_t(acc % uint32_t(SL))) * SUB;
                        for (int64_t c = 0; c < SUB; ++c) ej[k * SUB + c] = ok ? float(row[c]) : 0.0f;
                    }
                    T* ejh = eh.data() + ((g * B + b) * TAPS + j) * NS;
                    for (int64_t c = 0; c < NS; ++c) ejh[c] = static_cast<T>(ej[c]);
                }
        project(segs.data(), int64_t(segs.size()), NS, dp, vnni.data());
        #pragma omp for collapse(2) schedule(static)
        for (int64_t g = 0; g < SITES; ++g)
            for (int64_t b = 0; b < B; ++b) {
                const T* taps = reinterpret_cast<const T*>(table[4 * g + 3]);
                float* kb = key.data() + (g * B + b) * D;
                for (int64_t d = 0; d < D; d += W) rv(Vec::loadu(kb + d)).store(kb + d);
                Vec inv(1.0f / std::sqrt(sum_squares(kb, D) / D + EPS));  // rms_unit, as the stack reads the key
                for (int64_t d = 0; d < D; d += W) (Vec::loadu(kb + d) * inv).store(ek + (g * B + b) * D + d);
                for (int64_t d = 0; d < D; d += W) {  // Σ_j taps[j] ⊙ v[t - j·dil] · tap_ok[j], rounded per op
                    Vec acc(0);
                    for (int64_t j = 0; j < TAPS; ++j) {
                        const float* vj = val.data() + ((g * B + b) * TAPS + j) * D;
                        Vec term = hv[b * HW + HW - 1 - j * DIL] ? rv(load(taps + j * D + d) * rv(Vec::loadu(vj + d)))
                                                                 : Vec(0);
                        acc = j == 0 ? term : rv(acc + term);
                    }
                    store(ev + (g * B + b) * D + d, acc);
                }
            }
    }
}

#elif ENTRY == 3
// ---------------------------------------------------------------------------------------------- the step's logits
// lanes (B, N, D) SCALAR after the last layer -> logits (B, V) float32: the lane mean rounded to SCALAR (float32
// sum), final_norm, then f32(x)·f32(E)ᵀ against the tied embedding E (V, D) read in its own dtype.
// table: final_norm.scale, E.
extern "C" void kernel(const int64_t* table, const T* lanes, float* logits, int64_t B, int64_t V, int64_t dp) {
    Scratch<float> mean, x;
    Scratch<T> xh;
    Scratch<uint32_t> vnni;
    carve<float, 0>({{&mean, B * D}, {&x, B * D}});
    carve<T, 1>({{&xh, B * D}});
    carve<uint32_t, 2>({{&vnni, vnni_words(B, D)}});
    const Seg seg = {reinterpret_cast<const T*>(table[1]), V, x.data(), xh.data(), B, D, logits, V};
    #pragma omp parallel
    {
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < B; ++b) {
            for (int64_t d = 0; d < D; d += W) {
                Vec t(0);
                for (int64_t i = 0; i < N; ++i) t = t + load(lanes + (b * N + i) * D + d);
                rv(t / Vec(float(N))).store(mean.data() + b * D + d);
            }
            zc_norm(mean.data() + b * D, reinterpret_cast<const T*>(table[0]), x.data() + b * D, D);
            for (int64_t d = 0; d < D; d += W) store(xh.data() + b * D + d, Vec::loadu(x.data() + b * D + d));
        }
        project(&seg, 1, D, dp, vnni.data());
    }
}
#endif
