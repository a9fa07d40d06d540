// Runs the per-thread functions of quantizer/codec/kernel/trellis_encode.cu on a CPU (docs/encoder.md,
// "Our tile kernel"), one simulated thread after another between the kernel's barriers, so the search can be
// checked without a GPU (tests/test_encoder_kernel_host.py).
//
// The fp16 type and the intrinsics the kernel uses are defined here with IEEE round-to-nearest-even on every
// operation (GCC's _Float16 conversion from double rounds correctly): sums, differences and products of two
// fp16 values are exact in double and rounded once; a fused multiply-add rounds the exact a*b + c once (its
// double sum plus the exact rounding error of that sum decide a tie).
//
// stdin: int32 n, KA, KB (KB = KA at integer K, KA + 1 at the half rate KA + 0.5), codebook (0 3INST, 1 mcg,
// 2 mul1), then n x 256 float32 tiles.
// stdout: n x 256 int16 states, then n x 256 float32 reconstructed values.

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

struct half { uint16_t x; };
struct half2 { half a, b; };

static inline double half_value(half h)
{
    _Float16 f;
    std::memcpy(&f, &h.x, 2);
    return (double) f;
}

// Round v to fp16 (the conversion is correctly rounded); a nonzero err (the exact value is v + err, err far
// below one step of v) moves v one double step towards the exact value first, which decides a tie at a
// midpoint and changes nothing else: no fp16 value or midpoint lies strictly between two adjacent doubles
static inline half round_half(double v, double err = 0.0)
{
    if (err != 0.0) v = std::nextafter(v, err > 0.0 ? INFINITY : -INFINITY);
    const _Float16 f = (_Float16) v;
    half h;
    std::memcpy(&h.x, &f, 2);
    return h;
}

static inline half __ushort_as_half(unsigned short u) { return {u}; }
static inline unsigned short __half_as_ushort(half h) { return h.x; }
static inline float __half2float(half h) { return (float) half_value(h); }
static inline half __float2half_rn(float f) { return round_half((double) f); }
static inline half __hadd(half a, half b) { return round_half(half_value(a) + half_value(b)); }
static inline half __hsub(half a, half b) { return round_half(half_value(a) - half_value(b)); }
static inline half __hmul(half a, half b) { return round_half(half_value(a) * half_value(b)); }
static inline half __hfma(half a, half b, half c)
{
    const double p = half_value(a) * half_value(b), cv = half_value(c), s = p + cv;
    if (!std::isfinite(s)) return round_half(s);
    const double bb = s - p, err = (p - (s - bb)) + (cv - bb);  // s + err == p + cv exactly
    return round_half(s, err);
}
static inline half hmin(half a, half b) { return half_value(b) < half_value(a) ? b : a; }
static inline half2 __half2half2(half h) { return {h, h}; }
static inline half2 __halves2half2(half a, half b) { return {a, b}; }
static inline half __low2half(half2 h) { return h.a; }
static inline half __high2half(half2 h) { return h.b; }
static inline half2 __low2half2(half2 h) { return {h.a, h.a}; }
static inline half2 __high2half2(half2 h) { return {h.b, h.b}; }
static inline half2 __hsub2(half2 a, half2 b) { return {__hsub(a.a, b.a), __hsub(a.b, b.b)}; }
static inline half2 __hmul2(half2 a, half2 b) { return {__hmul(a.a, b.a), __hmul(a.b, b.b)}; }
static inline half2 __hfma2(half2 a, half2 b, half2 c) { return {__hfma(a.a, b.a, c.a), __hfma(a.b, b.b, c.b)}; }
static inline half __hmin(half a, half b) { return hmin(a, b); }
static inline half2 __hmin2(half2 a, half2 b) { return {hmin(a.a, b.a), hmin(a.b, b.b)}; }

#define TRELLIS_HOST 1
#include "trellis_encode.cu"

using namespace trellis;

// The kernel's work on one unit of T tiles (Geometry::T; a unit short of T repeats its first tile, as the
// kernel does), with its threads run in turn between barriers and warp 0's lanes in turn; `count` is how
// many of the unit's tiles are real
template <int KA, int KB, int CB>
static void encode_unit(const float* tiles, int count, float* vals, int16_t* states)
{
    using Gm = Geometry<KA, KB>;
    constexpr int T = Gm::T;
    using Dec = half2[Gm::Q][Gm::P];
    static std::unique_ptr<Dec[]> dec;
    if (!dec)
    {
        dec.reset(new Dec[NT]);
        for (int t = 0; t < NT; ++t) decode_thread<KA, KB, CB>(t, dec[t]);
    }
    std::vector<half> costs0((size_t) T * Gm::WIDE), costs1((size_t) T * Gm::WIDE), hist((size_t) T * Gm::HSIZE);
    std::vector<half> w((size_t) T * L);
    for (int u = 0; u < T; ++u)
        for (int i = 0; i < L; ++i) w[u * L + i] = __float2half_rn(tiles[(u < count ? u : 0) * L + i]);

    auto forward = [&](int roll, const int* pre, int keep_from)
    {
        int from[T];
        for (int u = 0; u < T; ++u) from[u] = pre ? pre[u] : -1;
        for (int i = 0; i < L; ++i)
        {
            half* next = (i & 1) ? costs1.data() : costs0.data();
            const half* prev = i == 0 ? nullptr : ((i & 1) ? costs0.data() : costs1.data());
            half* hrow = kept_row<KA, KB>(hist.data(), i, keep_from);
            half wi[T];
            for (int u = 0; u < T; ++u) wi[u] = w[u * L + ring(i, roll)];
            for (int t = 0; t < NT; ++t)
            {
                if (KA != KB && (i & 1)) forward_thread<KA, KB, true, false>(t, dec[t], wi, prev, next, hrow, from);
                else if (i == 0) forward_thread<KA, KB, false, true>(t, dec[t], wi, prev, next, hrow, from);
                else forward_thread<KA, KB, false, false>(t, dec[t], wi, prev, next, hrow, from);
            }
        }
    };
    auto traceback = [&](int u, int roll, int pre, int e, float* out_vals, int16_t* out_states)
    {
        const half* tw = &w[u * L];
        const half* th = &hist[(size_t) u * Gm::HSIZE];
        for (int i = L - 1; i >= 0; --i)
        {
            const int ri = ring(i, roll);
            const half w_prev = tw[ring(i > 0 ? i - 1 : 0, roll)];
            uint32_t best = NO_KEY;
            for (int k = 0; k < (1 << width_out<KA, KB>(i)); ++k)
            {
                half v[Gm::NV];
                gather_candidate<KA, KB>((uint32_t) k, (uint32_t) e, i, th, v);
                const half d = candidate_offset<KA, KB, CB>(k, (uint32_t) e, i, tw[ri]);
                const uint32_t key = candidate_key<KA, KB, CB>(k, (uint32_t) e, d, i, pre, v, w_prev);
                best = key < best ? key : best;
            }
            const uint32_t s = state_of(best, (uint32_t) e, width_out<KA, KB>(i));
            if (out_states)
            {
                out_states[ri] = (int16_t) (uint16_t) s;
                out_vals[ri] = __half2float(decode_state<CB>(s));
            }
            e = (int) (s >> width_in<KA, KB>(i));
            if (!out_states && ri == 0) break;
        }
        return e;
    };

    forward(L / 2, nullptr, pass1_keep_from<KA, KB>());
    int boundary[T];
    for (int u = 0; u < T; ++u)
    {
        uint32_t best = NO_KEY;
        for (int t = 0; t < NT; ++t)
        {
            const uint32_t key = final_key_thread<KA, KB>(t, costs1.data() + u * Gm::WIDE);
            best = key < best ? key : best;
        }
        boundary[u] = traceback(u, L / 2, -1, final_edge(best), nullptr, nullptr);
    }
    forward(0, boundary, 0);
    for (int u = 0; u < count; ++u) traceback(u, 0, boundary[u], boundary[u], vals + u * L, states + u * L);
}

template <int KA, int KB, int CB>
static void encode_tiles(const float* tiles, int n, float* vals, int16_t* states)
{
    constexpr int T = Geometry<KA, KB>::T;
    for (int i = 0; i < n; i += T)
        encode_unit<KA, KB, CB>(tiles + (size_t) i * L, n - i < T ? n - i : T, vals + (size_t) i * L, states + (size_t) i * L);
}

template <int KA, int KB>
static bool run_cb(int cb, const float* tiles, int n, float* vals, int16_t* states)
{
    if constexpr (KA != KB)
    {
        if (cb != 2) return false;  // half rates are mul1-only
        encode_tiles<KA, KB, 2>(tiles, n, vals, states);
        return true;
    }
    switch (cb)
    {
        case 0: encode_tiles<KA, KB, 0>(tiles, n, vals, states); return true;
        case 1: encode_tiles<KA, KB, 1>(tiles, n, vals, states); return true;
        case 2: encode_tiles<KA, KB, 2>(tiles, n, vals, states); return true;
        default: return false;
    }
}

static bool run(int ka, int kb, int cb, const float* tiles, int n, float* vals, int16_t* states)
{
    switch (ka * 10 + kb)
    {
        case 11: return run_cb<1, 1>(cb, tiles, n, vals, states);
        case 22: return run_cb<2, 2>(cb, tiles, n, vals, states);
        case 33: return run_cb<3, 3>(cb, tiles, n, vals, states);
        case 44: return run_cb<4, 4>(cb, tiles, n, vals, states);
        case 55: return run_cb<5, 5>(cb, tiles, n, vals, states);
        case 66: return run_cb<6, 6>(cb, tiles, n, vals, states);
        case 12: return run_cb<1, 2>(cb, tiles, n, vals, states);
        case 23: return run_cb<2, 3>(cb, tiles, n, vals, states);
        case 34: return run_cb<3, 4>(cb, tiles, n, vals, states);
        default: return false;
    }
}

int main()
{
    int32_t hdr[4];
    if (std::fread(hdr, sizeof(int32_t), 4, stdin) != 4) { std::fprintf(stderr, "no header\n"); return 2; }
    const int n = hdr[0], ka = hdr[1], kb = hdr[2], cb = hdr[3];
    std::vector<float> tiles((size_t) n * L), vals((size_t) n * L);
    std::vector<int16_t> states((size_t) n * L);
    if (std::fread(tiles.data(), sizeof(float), tiles.size(), stdin) != tiles.size()) { std::fprintf(stderr, "short input\n"); return 2; }
    if (!run(ka, kb, cb, tiles.data(), n, vals.data(), states.data()))
    {
        std::fprintf(stderr, "rate (%d, %d) codebook %d not built\n", ka, kb, cb);
        return 2;
    }
    std::fwrite(states.data(), sizeof(int16_t), states.size(), stdout);
    std::fwrite(vals.data(), sizeof(float), vals.size(), stdout);
    return 0;
}
