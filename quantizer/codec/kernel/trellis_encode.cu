// The project's own Viterbi tile encoder for EXL3 (issue 39; docs/encoder.md, "Our tile kernel").
//
// One 16x16 tile is a tail-biting ring of L = 256 positions, and the state after position p is a 16-bit
// window of the ring's bits. Position p shifts D(p) new bits in at the bottom: K at integer rates; at the
// half rates K = KA + 0.5 (mul1 only), KA at even p and KB = KA + 1 at odd p (exllamav3 1.6.5's `frac_k`,
// mask 0xAAAA). Step p's cost of a state depends only on the state's low 16 - D(p + 1) bits, its out-edge
// x, and its predecessor is the state shifted right by D(p): the 2^D(p+1) states of out-edge x are
// s = (k << (16 - D(p + 1))) | x, each from edge s >> D(p). At integer K every step is K wide (D(p) = D(p+1)).
// The search runs twice, as exllamav3 1.6.5 does (docs/exl3-format.md, encoder): pass 1 starts at the ring's
// middle without constraint and traces back to position 0 to find a boundary edge; pass 2 starts at
// position 0 from that edge and ends in it.
//
// What differs from exllamav3's kernels (`quantize_tiles`, `quantize_tiles_frac`), and why the codes stay
// the same:
// - every thread owns a fixed run of the states' low 16 - KB bits with all their top KB bits, 128 states,
//   so the decoded codebook values of its states are computed once per kernel launch and kept in registers.
//   At a KB-wide step (every step at integer K, the even ones at half rates) those are the out-edges of its
//   run with 2^KB candidates each; at a KA-wide step (the odd ones at half rates) the lowest of the top KB
//   bits joins the out-edge, so the thread owns two runs of out-edges, each with 2^KA candidates;
// - the forward pass keeps only the minimum cost per edge (half2 sub, fma, min per pair of edges and
//   candidate), no argmin index; the kept steps' minima go to a global history;
// - the traceback recomputes, for the edge on the path, the candidate costs with the same fp16 operations
//   (sub, then fma with the stored predecessor cost; a plain square at step 0) and takes the smallest cost,
//   lowest k first: the same value and the same first-index tie rule as a running strict-less argmin;
// - where KA is 1 or 2 (K 1, 1.5, 2, 2.5), where a step's minima are 16-64 KiB and writing them bounds the
//   search, the history keeps the even steps' minima only (the narrower ones at half rates); the traceback
//   recomputes an odd step's minimum from the step before it with the forward pass's operations (a
//   minimum of the same values in any order is the same value);
// - the minima are placed to avoid shared-memory bank conflicts (cost_slot) and to coalesce the history
//   writes (hist_slot): places change, values do not;
// - a forward pass runs the same step of two tiles at K 2, 2.5, 3, 4 and 5 (Geometry::T), and a block keeps two
//   such units in flight, so that each traceback runs beside the next forward pass (see the kernel); each
//   tile's search is unchanged;
// - the reconstructed values are decoded from the written states once a block's tiles are done, not by the
//   traceback as it goes.
// The final-edge choice after pass 1 uses exllamav3's tie order over equal costs (bit-reversed warp, then
// bit-reversed lane, then 1024-state stripe), written out below as `edge_rank`.
//
// The per-thread work (decode, one forward step, the final-edge key, one traceback candidate) is written as
// plain functions and the kernel only orders them between barriers. Built with TRELLIS_HOST defined (and a
// host definition of the fp16 types and intrinsics, tests/encoder_kernel_host.cpp), the same functions run
// on a CPU, one simulated thread after another, so the search can be checked without a GPU.

#ifdef TRELLIS_HOST
#define TE_FN inline
#else
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_fp16.h>
#define TE_FN __device__ __forceinline__
#endif
#include <cstdint>

namespace trellis {

constexpr int L = 256;          // positions per tile (ring)
constexpr int NT = 512;         // threads per block; all run the forward pass, warp 0 also traces back
constexpr uint32_t NO_KEY = 0xffffffffu;

// A rate's thread layout: KB = KA for integer K, KB = KA + 1 for the half rate KA + 0.5
template <int KA, int KB = KA>
struct Geometry
{
    static_assert(KB == KA || KB == KA + 1, "an integer rate (KB = KA) or a half rate (KB = KA + 1)");
    static constexpr int NARROW = 65536 >> KB;                // out-edges of a KB-wide step
    static constexpr int WIDE = 65536 >> KA;                  // out-edges of a KA-wide step: a cost buffer's size
    static constexpr int E = NARROW / NT;                     // a thread's run of low 16 - KB state bits
    static constexpr int P = E / 2;                           // pairs of them (one half2 each)
    static constexpr int Q = 1 << KB;                         // top bits of a thread's states
    static constexpr int STRIDE = KA <= 2 ? 2 : 1;            // the history keeps every STRIDE-th step's minima
    static constexpr int ROWS = L / STRIDE;                   // history rows per block
    static constexpr int ROW = STRIDE == 2 ? NARROW : WIDE;   // and their size (stride 2 keeps KB-wide steps only)
    static constexpr int NV = STRIDE == 2 ? 1 << KA : 1;      // history minima a traceback candidate reads
    static constexpr int R = (Q + 31) / 32;                   // traceback candidates per lane of warp 0
    static constexpr int HSIZE = ROWS * ROW;                  // one tile's history (minima)
    // tiles per forward pass (see the kernel): two at K 2, 2.5, 3, 4 and 5, where they measured faster than one
    // (H100, docs/encoder.md, "Two tiles per forward pass"); their four cost buffers fit in shared memory from
    // KA 2 up (128 KiB at K 2). At K 3.5 and 6 two tiles' registers spilled and ran slower; K 1 and 1.5 would
    // need 256 KiB
    static constexpr int T = (KA == KB && KA >= 2 && KA <= 5) || (KA == 2 && KB == 3) ? 2 : 1;
    static constexpr int PARTS = P * T >= 16 ? P * T / 8 : 1; // pieces of a run per forward step (forward_thread)
    static constexpr int UNITS = E / 8;                       // 16-byte units in a thread's run of minima
    static constexpr int SPREAD = UNITS >= 8 ? 0 : UNITS == 4 ? 1 : 2;  // log2(8 / UNITS), see cost_slot
    static_assert(E >= 2 && (E % 2) == 0 && 16 - KA - KB >= 0, "K outside this thread layout");
};

// Step j of a pass at ring position j + roll (the roll is even, so both have j's parity): its widths D(p) and
// D(p + 1), and how a thread's states map onto its out-edges and their predecessors
template <int KA, int KB, bool ODD>
struct Step
{
    using Gm = Geometry<KA, KB>;
    static constexpr int KIN = ODD ? KB : KA;                 // bits shifted in at this position
    static constexpr int KOUT = ODD ? KA : KB;                // and at the next: the out-edge is 16 - KOUT bits
    static constexpr int NG = 1 << (KB - KOUT);               // out-edges per run entry: the low KB - KOUT top bits
    static constexpr int SHIFT = 16 - KB - KIN;               // where a state's top KB bits sit in its predecessor
    static constexpr int PE = Gm::E / Gm::PARTS;              // run entries per part
    static constexpr int PG = (PE >> KIN) > 0 ? (PE >> KIN) : 1;  // distinct predecessors per part and top bits
};

// The same at a step index known only at run time (the traceback's)
template <int KA, int KB>
TE_FN int width_in(int i) { return (i & 1) ? KB : KA; }
template <int KA, int KB>
TE_FN int width_out(int i) { return (i & 1) ? KA : KB; }

// Codebooks (docs/exl3-format.md, decode step 4): 0 = 3INST, 1 = mcg, 2 = mul1
template <int CB>
TE_FN half decode_state(uint32_t s)
{
    if constexpr (CB == 2)
    {
        const uint32_t x = s * 0x83DCD12Du;
        const uint32_t bytes = (x & 0xffu) + ((x >> 8) & 0xffu) + ((x >> 16) & 0xffu) + (x >> 24);
        // 0x6400 + c is the fp16 bit pattern of 1024 + c (c <= 1020); one fused rounding
        const half h = __ushort_as_half((unsigned short) (0x6400u + bytes));
        return __hfma(h, __ushort_as_half(0x1eee), __ushort_as_half(0xc931));
    }
    else
    {
        uint32_t x = CB == 1 ? s * 0xCBAC1FEDu : s * 89226354u + 64248484u;
        x = (x & 0x8fff8fffu) ^ 0x3b603b60u;
        return __hadd(__ushort_as_half((unsigned short) (x & 0xffffu)), __ushort_as_half((unsigned short) (x >> 16)));
    }
}

TE_FN half inf_half() { return __ushort_as_half(0x7c00); }

// N / 2 pairs of consecutive halves from shared memory into registers (N even), in the widest aligned pieces
template <int N>
TE_FN void load_pairs(half2* dst, const half* src)
{
#ifdef TRELLIS_HOST
    for (int i = 0; i < N / 2; ++i) dst[i] = __halves2half2(src[2 * i], src[2 * i + 1]);
#else
    if constexpr (N % 8 == 0)
    {
        #pragma unroll
        for (int i = 0; i < N / 8; ++i)
            *reinterpret_cast<uint4*>(&dst[4 * i]) = reinterpret_cast<const uint4*>(src)[i];
    }
    else if constexpr (N % 4 == 0)
    {
        #pragma unroll
        for (int i = 0; i < N / 4; ++i)
            *reinterpret_cast<uint2*>(&dst[2 * i]) = reinterpret_cast<const uint2*>(src)[i];
    }
    else
    {
        #pragma unroll
        for (int i = 0; i < N / 2; ++i) dst[i] = reinterpret_cast<const half2*>(src)[i];
    }
#endif
}

template <int P>
TE_FN void store_pairs(half* dst, const half2 (&src)[P])
{
#ifdef TRELLIS_HOST
    for (int i = 0; i < P; ++i) { dst[2 * i] = __low2half(src[i]); dst[2 * i + 1] = __high2half(src[i]); }
#else
    if constexpr (P % 4 == 0)
    {
        #pragma unroll
        for (int i = 0; i < P / 4; ++i)
            reinterpret_cast<uint4*>(dst)[i] = *reinterpret_cast<const uint4*>(&src[4 * i]);
    }
    else if constexpr (P % 2 == 0)
    {
        #pragma unroll
        for (int i = 0; i < P / 2; ++i)
            reinterpret_cast<uint2*>(dst)[i] = *reinterpret_cast<const uint2*>(&src[2 * i]);
    }
    else
    {
        #pragma unroll
        for (int i = 0; i < P; ++i) reinterpret_cast<half2*>(dst)[i] = src[i];
    }
#endif
}

// Where edge x's minimum sits in the shared cost buffers. A thread stores its run of E minima as UNITS
// 16-byte units, and a warp stores 16-byte pieces eight threads at a time: where a run is 2, 4 or 8 units
// (KB 3, 2, 1) those eight threads' pieces would fall in 4, 2 or 1 of the 8 bank groups, so every store
// would wait 2, 4 or 8 times over. Each thread's units are therefore XOR-permuted by its index, spreading
// the eight threads over all 8 groups; loads of any aligned run of 8 units stay within one permuted run.
// A KA-wide buffer (half rates) is two KB-wide halves, x = (g << (16 - KB)) | e, each placed the same way.
// Only the place changes, never a value (the history in global memory has its own order, hist_slot).
// At integer K every x is below NARROW, and the half's bit is not masked at all: that mask alone made the
// K 3 kernel 4% slower (docs/encoder.md, "The half rates, and pieces of 8 pairs").
template <int KA, int KB>
TE_FN int cost_slot(int x)
{
    using Gm = Geometry<KA, KB>;
    if constexpr (Gm::UNITS < 2) return x;
    else
    {
        const int e = KA == KB ? x : x & (Gm::NARROW - 1);
        const int half_bit = KA == KB ? 0 : x & ~(Gm::NARROW - 1);
        const int unit = e >> 3;
        const int owner = unit / Gm::UNITS;
        return half_bit | ((unit ^ ((owner >> Gm::SPREAD) & (Gm::UNITS - 1))) << 3) | (e & 7);
    }
}

// N minima of consecutive edges from `start` (N a power of two; aligned runs never straddle a unit) out of
// a shared cost buffer, as N / 2 pairs (one unit or less at a time), or where N is 1 as that minimum twice
template <int KA, int KB, int N>
TE_FN void load_cost_pairs(half2 (&dst)[(N + 1) / 2], const half* costs, int start)
{
    if constexpr (N == 1)
    {
        dst[0] = __half2half2(costs[cost_slot<KA, KB>(start)]);
    }
    else
    {
        constexpr int PIECE = N < 8 ? N : 8;
        #pragma unroll
        for (int i = 0; i < N / PIECE; ++i)
            load_pairs<PIECE>(&dst[PIECE / 2 * i], costs + cost_slot<KA, KB>(start + PIECE * i));
    }
}

// Where edge x's minimum sits in a history row (global memory). Stored in a thread's plain order, each of a
// warp's 16-byte stores would touch 32 separate lines wherever a run is 2 units or more (KB 1-3): cutting
// the history writes out of the kernel made it 3.5x faster at K 1 and 1.6x at K 2 (H100). So a row is laid
// out unit-major: unit 0 of every thread's run, then unit 1, ..., and each warp store writes 512
// contiguous bytes; a KA-wide row is two such halves. The traceback reads single minima, through this map.
template <int KA, int KB>
TE_FN int hist_slot(int x)
{
    using Gm = Geometry<KA, KB>;
    if constexpr (Gm::UNITS < 2) return x;
    else
    {
        const int unit = (KA == KB ? x : x & (Gm::NARROW - 1)) >> 3;
        const int half_bit = KA == KB ? 0 : x & ~(Gm::NARROW - 1);
        return half_bit | ((((unit % Gm::UNITS) * NT + unit / Gm::UNITS) << 3) | (x & 7));
    }
}

// Thread t's P pairs of minima from its pair p0 on into a history row (or its half), in hist_slot's order
template <int KA, int KB, int P>
TE_FN void store_history(half* row, int t, const half2 (&src)[P], int p0 = 0)
{
    using Gm = Geometry<KA, KB>;
    if constexpr (Gm::UNITS < 2) store_pairs<P>(row + t * Gm::E + 2 * p0, src);
    else
    {
        #pragma unroll
        for (int c = 0; c < P / 4; ++c)
        {
            alignas(16) half2 piece[4];
            #pragma unroll
            for (int j = 0; j < 4; ++j) piece[j] = src[4 * c + j];
            store_pairs<4>(row + (((p0 / 4 + c) * NT + t) << 3), piece);
        }
    }
}

// Thread t's P pairs of minima of consecutive edges from x0 into a shared cost buffer, a unit (or less) at a time
template <int KA, int KB, int P>
TE_FN void store_costs(half* costs, int x0, const half2 (&src)[P])
{
    constexpr int PIECE = P < 4 ? P : 4;  // pairs per store
    #pragma unroll
    for (int i = 0; i < P / PIECE; ++i)
    {
        alignas(16) half2 piece[PIECE];
        #pragma unroll
        for (int j = 0; j < PIECE; ++j) piece[j] = src[PIECE * i + j];
        store_pairs<PIECE>(costs + cost_slot<KA, KB>(x0 + 2 * PIECE * i), piece);
    }
}

TE_FN uint32_t rev5(uint32_t x)
{
#ifdef TRELLIS_HOST
    uint32_t r = 0;
    for (int b = 0; b < 5; ++b) r |= ((x >> b) & 1u) << (4 - b);
    return r;
#else
    return __brev(x) >> 27;
#endif
}

// The tie order over equal final costs: an edge's rank (unique, 16 bits), and back
TE_FN uint32_t edge_rank(uint32_t e)
{
    const uint32_t low = e & 1023u;
    return (rev5(low >> 5) << 10) | (rev5(low & 31u) << 5) | (e >> 10);
}
TE_FN uint32_t rank_edge(uint32_t r)
{
    return ((r & 31u) << 10) | (rev5(r >> 10) << 5) | rev5((r >> 5) & 31u);
}

// Thread t's decoded values: dec[k][j] holds the states (k << (16 - KB)) | e for its pair j of run entries e
template <int KA, int KB, int CB>
TE_FN void decode_thread(int t, half2 (&dec)[Geometry<KA, KB>::Q][Geometry<KA, KB>::P])
{
    using Gm = Geometry<KA, KB>;
    const int e0 = t * Gm::E;
    #pragma unroll
    for (int k = 0; k < Gm::Q; ++k)
    {
        #pragma unroll
        for (int j = 0; j < Gm::P; ++j)
        {
            const uint32_t s = ((uint32_t) k << (16 - KB)) | (uint32_t) (e0 + 2 * j);
            dec[k][j] = __halves2half2(decode_state<CB>(s), decode_state<CB>(s + 1));
        }
    }
}

// One forward step for thread t, for the T tiles of a forward pass (Geometry::T; their weights `w`): the
// minimum over the candidates of every out-edge it owns, into `next` (and `hrow` when not null), tile u's
// cost buffers at u * WIDE and its history at u * HSIZE. ODD: a KA-wide step of a half rate (Step). FIRST: the
// first step of a pass, a plain square, only from edge pre[u] where that is >= 0 (`prev` unused); a
// template argument, so that the other 255 steps run without a branch per candidate and take each
// predecessor cost straight from the loaded pair (docs/encoder.md, "What limited it next"). The boundary
// edges come in registers: read through a pointer into shared memory that the cost stores might alias, they
// put a branch around every candidate of the first step (docs/encoder.md, "Boundary edges by value"). Each decoded
// value is read once for all T tiles. A run of more than 8 pairs (K 1, 1.5 and 2) is done in pieces of 8,
// each with its own minima and predecessor costs: a whole run's minima beside the decoded values and the
// traceback's did not fit in the registers at K 1 (the compiler spilled them), and pieces of 8 pairs were
// 5-6% faster at K 1 and 2 than pieces of 16 (H100, bench/encoder_kernel.py)
template <int KA, int KB, bool ODD, bool FIRST>
TE_FN void forward_thread(int t, const half2 (&dec)[Geometry<KA, KB>::Q][Geometry<KA, KB>::P],
                          const half (&w)[Geometry<KA, KB>::T], const half* prev, half* next, half* hrow,
                          const int (&pre)[Geometry<KA, KB>::T])
{
    using Gm = Geometry<KA, KB>;
    using St = Step<KA, KB, ODD>;
    constexpr int T = Gm::T;
    constexpr int PP = Gm::P / Gm::PARTS;   // pairs per part
    half2 w2[T];
    #pragma unroll
    for (int u = 0; u < T; ++u) w2[u] = __half2half2(w[u]);
    #pragma unroll
    for (int part = 0; part < Gm::PARTS; ++part)
    {
        const int p0 = part * PP;             // the part's first pair
        const int e = t * Gm::E + 2 * p0;     // and its first run entry (a multiple of 2^KIN)
        alignas(16) half2 m[T][St::NG][PP];  // aligned for the vector stores of store_costs
        #pragma unroll
        for (int k = 0; k < Gm::Q; ++k)
        {
            const int g = k & (St::NG - 1);   // which of the thread's out-edge runs state k of an entry ends in
            alignas(16) half2 c[T][(St::PG + 1) / 2];  // aligned for the vector loads of load_pairs
            if constexpr (!FIRST)
            {
                #pragma unroll
                for (int u = 0; u < T; ++u)
                    load_cost_pairs<KA, KB, St::PG>(c[u], prev + u * Gm::WIDE, (k << St::SHIFT) | (e >> St::KIN));
            }
            #pragma unroll
            for (int j = 0; j < PP; ++j)
            {
                #pragma unroll
                for (int u = 0; u < T; ++u)
                {
                    const half2 d = __hsub2(dec[k][p0 + j], w2[u]);
                    half2 v;
                    if constexpr (FIRST)
                    {
                        v = __hmul2(d, d);
                        if (pre[u] >= 0 && ((k << St::SHIFT) | ((e + 2 * j) >> St::KIN)) != pre[u]) v = __half2half2(inf_half());
                    }
                    else
                    {
                        // entries 2j and 2j + 1 share their predecessor: cost (2j) >> KIN of the part, both halves
                        const int ci = St::PG == 1 ? 0 : (2 * j) >> St::KIN;
                        v = __hfma2(d, d, (ci & 1) ? __high2half2(c[u][ci >> 1]) : __low2half2(c[u][ci >> 1]));
                    }
                    m[u][g][j] = k < St::NG ? v : __hmin2(m[u][g][j], v);
                }
            }
        }
        #pragma unroll
        for (int u = 0; u < T; ++u)
        {
            #pragma unroll
            for (int g = 0; g < St::NG; ++g)
            {
                store_costs<KA, KB, PP>(next + u * Gm::WIDE, (g << (16 - KB)) | e, m[u][g]);
                if (hrow) store_history<KA, KB, PP>(hrow + u * Gm::HSIZE + g * Gm::NARROW, t, m[u][g], p0);
            }
        }
    }
}

// Thread t's smallest (cost bits << 16 | rank) over its out-edges of the final step (an odd one)
template <int KA, int KB>
TE_FN uint32_t final_key_thread(int t, const half* costs)
{
    using Gm = Geometry<KA, KB>;
    const int e0 = t * Gm::E;
    uint32_t best = NO_KEY;
    #pragma unroll
    for (int g = 0; g < Step<KA, KB, true>::NG; ++g)
    {
        #pragma unroll
        for (int j = 0; j < Gm::E; ++j)
        {
            const uint32_t x = ((uint32_t) g << (16 - KB)) | (uint32_t) (e0 + j);
            const uint32_t key = ((uint32_t) __half_as_ushort(costs[cost_slot<KA, KB>((int) x)]) << 16) | edge_rank(x);
            best = key < best ? key : best;
        }
    }
    return best;
}

// The final edge from the block's smallest key; every cost infinite: edge 0, as exllamav3 does
TE_FN int final_edge(uint32_t best) { return best >= 0x7c000000u ? 0 : (int) rank_edge(best & 0xffffu); }

// The history row that keeps step i's minima, or -1 for a step it skips (STRIDE 2: the odd ones)
template <int KA, int KB>
TE_FN int history_row(int i) { return Geometry<KA, KB>::STRIDE == 1 ? i : ((i & 1) ? -1 : (i >> 1)); }

// The history minima the traceback needs for candidate k of edge e at position index i (see candidate_key):
// step i - 1's minimum of the candidate's predecessor edge, or where the history skips step i - 1 (odd, so
// KB bits in and KA out), step i - 2's minima of that edge's 2^KA predecessors (none at i = 0). Gathered
// apart from the arithmetic, so that the kernel can load them one forward step before it needs them
template <int KA, int KB>
TE_FN void gather_candidate(uint32_t k, uint32_t e, int i, const half* hist, half (&v)[Geometry<KA, KB>::NV])
{
    using Gm = Geometry<KA, KB>;
    if (i == 0) return;
    const uint32_t in = (((uint32_t) k << (16 - width_out<KA, KB>(i))) | e) >> width_in<KA, KB>(i);
    const int r = i - 1;
    if (history_row<KA, KB>(r) >= 0)
    {
        v[0] = hist[(size_t) history_row<KA, KB>(r) * Gm::ROW + hist_slot<KA, KB>((int) in)];
        return;
    }
    if constexpr (Gm::NV > 1)
    {
        #pragma unroll
        for (int j = 0; j < Gm::NV; ++j)
            v[j] = hist[(size_t) history_row<KA, KB>(r - 1) * Gm::ROW
                        + hist_slot<KA, KB>((int) ((((uint32_t) j << (16 - KA)) | in) >> KB))];
    }
}

// The minimum cost of edge x after step r as the forward pass computed it, from the gathered minima: the
// kept one, or for a step the history skips, recomputed over x's 2^KA predecessors
template <int KA, int KB, int CB>
TE_FN half step_cost(uint32_t x, int r, half w_r, const half (&v)[Geometry<KA, KB>::NV])
{
    using Gm = Geometry<KA, KB>;
    if (history_row<KA, KB>(r) >= 0) return v[0];
    half m = inf_half();
    #pragma unroll
    for (int j = 0; j < Gm::NV; ++j)
    {
        const half d = __hsub(decode_state<CB>(((uint32_t) j << (16 - KA)) | x), w_r);
        const half c = __hfma(d, d, v[j]);
        m = j == 0 ? c : __hmin(m, c);
    }
    return m;
}

// Traceback, candidate k of edge e at position index i: its decoded value less the position's weight, the
// part that needs no history (the kernel computes it before the forward work, the rest after)
template <int KA, int KB, int CB>
TE_FN half candidate_offset(int k, uint32_t e, int i, half w)
{
    return __hsub(decode_state<CB>(((uint32_t) k << (16 - width_out<KA, KB>(i))) | e), w);
}

// and its key (cost bits << 16 | k), recomputed with the forward pass's operations from that offset d and
// step i - 1's minima, gathered into v (`w_prev`: that step's weight; unused at i = 0)
template <int KA, int KB, int CB>
TE_FN uint32_t candidate_key(int k, uint32_t e, half d, int i, int pre, const half (&v)[Geometry<KA, KB>::NV],
                             half w_prev)
{
    const uint32_t in = (((uint32_t) k << (16 - width_out<KA, KB>(i))) | e) >> width_in<KA, KB>(i);
    half c;
    if (i == 0)
    {
        c = __hmul(d, d);
        if (pre >= 0 && (int) in != pre) c = inf_half();
    }
    else
    {
        c = __hfma(d, d, step_cost<KA, KB, CB>(in, i - 1, w_prev, v));
    }
    return ((uint32_t) __half_as_ushort(c) << 16) | (uint32_t) k;
}

// The state of the least key's candidate for out-edge e of a step whose next position is `kout` bits wide
TE_FN uint32_t state_of(uint32_t best, uint32_t e, int kout) { return ((best & 0xffffu) << (16 - kout)) | e; }

TE_FN int ring(int i, int roll) { return i + roll >= L ? i + roll - L : i + roll; }

// Which steps' minima the traceback reads: pass 1 (roll L/2) traces back to ring position 0, index L/2,
// and reads steps L/2 - 1 .. L - 2; pass 2 reads steps 0 .. L - 2. The history keeps those of them that
// history_row gives a row, and at stride 2 step L/2 - 2 too (step L/2 - 1 is odd: recomputed from it)
template <int KA, int KB>
constexpr int pass1_keep_from() { return Geometry<KA, KB>::STRIDE == 2 ? L / 2 - 2 : L / 2 - 1; }

template <int KA, int KB>
TE_FN half* kept_row(half* hist, int i, int keep_from)
{
    return i >= keep_from && i <= L - 2 && history_row<KA, KB>(i) >= 0
        ? hist + (size_t) history_row<KA, KB>(i) * Geometry<KA, KB>::ROW : nullptr;
}

#ifndef TRELLIS_HOST

// The tracebacks of one forward pass's tiles, waiting for the next pass (in shared memory) or running beside
// it (warp 0's registers). They move in step: same pass, same positions; only their edges differ. T entries
// each, not two: the one-tile kernel's warp 0 keeps no unused fields in its registers
template <int T>
struct Trace
{
    int active;   // 0: none
    int slot;     // the tile slot that holds their weights
    int roll;     // L/2 for pass 1 (which yields the boundary edges), 0 for pass 2 (which writes states)
    int buf;      // the history buffer they read
    int pre[T];   // pass 2: each tile's boundary edge; pass 1: -1
    int e[T];     // each tile's edge at its next position
    int tile[T];  // pass 2: the tile whose states it writes, -1 for none (a slot's missing second tile)
};

// One block encodes its tiles in units of T (Geometry::T): a forward pass runs the same step of the unit's T
// tiles between the same barriers, each decoded value read once for all of them, so that every barrier and
// every wait on a result is shared by T tiles' work (at one tile per pass the step loop was latency-bound
// with a quarter of its stalls at the barrier: docs/encoder.md, "What limited it next"). Two units are in
// flight, so that every traceback runs beside a forward pass instead of after it (tracebacks were a third
// of the kernel's time at K 2-4 on an H100: bench/encoder_kernel.py, with them cut out). Per pair of units
// a, b the forward passes run F1(a), F1(b), F2(a), F2(b), and during each one warp 0 follows the tracebacks
// of the pass before it: T2 of the previous pair's b, T1(a), T1(b), T2(a); T2(b) runs beside the next
// pair's F1(a). Each traceback position gathers its history minima before warp 0's forward work and
// resolves after it, so the loads' latency is hidden too. Forward passes write the two history buffers in
// turn, and a traceback reads the one the pass before wrote. A last unit without a pair traces its pass 1
// back on its own; the block's last pass 2 is traced after the loop. A unit short of T tiles repeats its
// first tile's weights in the missing place and writes nothing for it.
template <int KA, int KB, int CB>
__global__ void __launch_bounds__(NT, 1)
trellis_encode_kernel(const float* __restrict__ tiles, float* __restrict__ out_values,
                      int16_t* __restrict__ out_states, half* __restrict__ history, int num_tiles)
{
    using Gm = Geometry<KA, KB>;
    constexpr int T = Gm::T;
    constexpr int WARPS = NT / 32;
    constexpr size_t HBUF = (size_t) T * Gm::HSIZE;               // one history buffer: a pass's T tiles
    extern __shared__ __align__(16) uint8_t smem[];
    half* costs0 = reinterpret_cast<half*>(smem);                  // T cost buffers each
    half* costs1 = costs0 + T * Gm::WIDE;
    half* sh_w = costs1 + T * Gm::WIDE;                            // two slots of T tiles in fp16
    uint32_t* sh_red = reinterpret_cast<uint32_t*>(sh_w + 2 * T * L);  // one word per warp and tile
    int* sh_bound = reinterpret_cast<int*>(sh_red + T * WARPS);     // the boundary edge of each slot's tiles
    Trace<T>* sh_tr = reinterpret_cast<Trace<T>*>(sh_bound + 2 * T);

    const int t = threadIdx.x;
    const int lane = t & 31;
    half* hists = history + (size_t) blockIdx.x * 2 * HBUF;
    const int count = num_tiles > (int) blockIdx.x ? (num_tiles - 1 - (int) blockIdx.x) / (int) gridDim.x + 1 : 0;
    const int units = (count + T - 1) / T;
    auto tile_of = [&](int n) { return (int) blockIdx.x + n * (int) gridDim.x; };

    // Decoded values of this thread's states, kept for every step of every tile
    half2 dec[Gm::Q][Gm::P];
    decode_thread<KA, KB, CB>(t, dec);
    if (t == 0) sh_tr->active = 0;

    // Warp 0 takes the pending tracebacks into its registers (where they stay while they run: nothing else
    // reads them) and marks the shared copy taken
    auto tb_take = [&]()
    {
        const Trace<T> tr = *sh_tr;
        __syncwarp();
        if (lane == 0) sh_tr->active = 0;
        return tr;
    };
    // Warp 0, before its forward work: the history minima of the tracebacks' position for forward step j
    // (position L-1-j) and the candidates' offsets, everything that does not wait for those loads
    auto tb_gather = [&](const Trace<T>& tr, int j, half (&v)[T][Gm::R][Gm::NV], half (&d)[T][Gm::R])
    {
        const int i = L - 1 - j;
        #pragma unroll
        for (int u = 0; u < T; ++u)
        {
            const half* hist = hists + tr.buf * HBUF + u * Gm::HSIZE;
            const half wi = sh_w[(tr.slot * T + u) * L + ring(i, tr.roll)];
            #pragma unroll
            for (int r = 0; r < Gm::R; ++r)
            {
                const int k = lane + 32 * r;
                if (k < (1 << width_out<KA, KB>(i)))
                {
                    gather_candidate<KA, KB>((uint32_t) k, (uint32_t) tr.e[u], i, hist, v[u][r]);
                    d[u][r] = candidate_offset<KA, KB, CB>(k, (uint32_t) tr.e[u], i, wi);
                }
            }
        }
    };
    // Warp 0, after it: that position's least candidate of each tile (first on ties), its state written in
    // pass 2, the edge before it kept for the next position; pass 1 stops at ring position 0 with the
    // boundary edges
    auto tb_resolve = [&](Trace<T>& tr, int j, const half (&v)[T][Gm::R][Gm::NV], const half (&d)[T][Gm::R])
    {
        const int i = L - 1 - j;
        const int ri = ring(i, tr.roll);
        uint32_t best[T];
        #pragma unroll
        for (int u = 0; u < T; ++u)
        {
            const half w_prev = Gm::NV > 1 ? sh_w[(tr.slot * T + u) * L + ring(i > 0 ? i - 1 : 0, tr.roll)] : half();
            best[u] = NO_KEY;
            #pragma unroll
            for (int r = 0; r < Gm::R; ++r)
            {
                const int k = lane + 32 * r;
                if (k < (1 << width_out<KA, KB>(i)))
                    best[u] = min(best[u], candidate_key<KA, KB, CB>(k, (uint32_t) tr.e[u], d[u][r], i, tr.pre[u],
                                                                     v[u][r], w_prev));
            }
        }
        #pragma unroll
        for (int u = 0; u < T; ++u)
        {
            best[u] = __reduce_min_sync(0xffffffffu, best[u]);
            const uint32_t s = state_of(best[u], (uint32_t) tr.e[u], width_out<KA, KB>(i));
            tr.e[u] = (int) (s >> width_in<KA, KB>(i));
            if (lane == 0 && tr.tile[u] >= 0) out_states[(size_t) tr.tile[u] * L + ri] = (int16_t) (uint16_t) s;
        }
        if (tr.roll != 0 && ri == 0)
        {
            if (lane == 0)
                for (int u = 0; u < T; ++u) sh_bound[tr.slot * T + u] = tr.e[u];
            tr.active = 0;
        }
        else if (i == 0)
        {
            tr.active = 0;
        }
    };

    int buf = 0;  // the history buffer the next forward pass writes

    // A forward pass over all L steps of the unit in `slot` (ring rolled by `roll`), from the edges `pre`
    // (null: unconstrained), keeping the history rows of steps from keep_from on; warp 0 follows the pending
    // tracebacks beside it. The last step's minima end in costs1 (L is even)
    auto forward = [&](int slot, int roll, const int* pre, int keep_from)
    {
        half* hist = hists + buf * HBUF;
        const half* w = sh_w + slot * T * L;
        int from[T];
        #pragma unroll
        for (int u = 0; u < T; ++u) from[u] = pre ? pre[u] : -1;
        Trace<T> tr{};
        if (t < 32) tr = tb_take();
        for (int j = 0; j < L; ++j)
        {
            half v[T][Gm::R][Gm::NV], d[T][Gm::R];
            if (t < 32 && tr.active) tb_gather(tr, j, v, d);
            half* next = (j & 1) ? costs1 : costs0;
            half* hrow = kept_row<KA, KB>(hist, j, keep_from);
            const half* prev = (j & 1) ? costs0 : costs1;
            half wj[T];
            #pragma unroll
            for (int u = 0; u < T; ++u) wj[u] = w[u * L + ring(j, roll)];
            // at integer K odd and even steps are the same step, one instantiation
            if (KA != KB && (j & 1)) forward_thread<KA, KB, true, false>(t, dec, wj, prev, next, hrow, from);
            else if (j == 0) forward_thread<KA, KB, false, true>(t, dec, wj, nullptr, next, hrow, from);
            else forward_thread<KA, KB, false, false>(t, dec, wj, prev, next, hrow, from);
            if (t < 32 && tr.active) tb_resolve(tr, j, v, d);
            __syncthreads();
        }
    };
    // The pending tracebacks alone, where no forward pass is left to run beside them
    auto drain = [&]()
    {
        if (t < 32)
        {
            Trace<T> tr = tb_take();
            for (int j = 0; j < L && tr.active; ++j)
            {
                half v[T][Gm::R][Gm::NV], d[T][Gm::R];
                tb_gather(tr, j, v, d);
                tb_resolve(tr, j, v, d);
            }
        }
        __syncthreads();
    };
    // After pass 1 of the unit in `slot`: its tracebacks are pending, each from its final edge of least cost
    auto pass1_done = [&](int slot)
    {
        #pragma unroll
        for (int u = 0; u < T; ++u)
        {
            const uint32_t best = __reduce_min_sync(0xffffffffu, final_key_thread<KA, KB>(t, costs1 + u * Gm::WIDE));
            if (lane == 0) sh_red[u * WARPS + (t >> 5)] = best;
        }
        __syncthreads();
        if (t < 32)
        {
            Trace<T> tr{1, slot, L / 2, buf};
            #pragma unroll
            for (int u = 0; u < T; ++u)
            {
                tr.pre[u] = tr.tile[u] = -1;
                tr.e[u] = final_edge(__reduce_min_sync(0xffffffffu, lane < WARPS ? sh_red[u * WARPS + lane] : NO_KEY));
            }
            if (lane == 0) *sh_tr = tr;
        }
        buf ^= 1;
        __syncthreads();
    };
    // After pass 2 of unit n in `slot`: its tracebacks are pending, each from and to its tile's boundary edge
    auto pass2_done = [&](int slot, int n)
    {
        if (t == 0)
        {
            Trace<T> tr{1, slot, 0, buf};
            for (int u = 0; u < T; ++u)
            {
                tr.pre[u] = tr.e[u] = sh_bound[slot * T + u];
                tr.tile[u] = n * T + u < count ? tile_of(n * T + u) : -1;
            }
            *sh_tr = tr;
        }
        buf ^= 1;
        __syncthreads();
    };
    auto load_unit = [&](int slot, int n)
    {
        for (int i = t; i < T * L; i += NT)
        {
            const int m = n * T + i / L < count ? n * T + i / L : n * T;
            sh_w[slot * T * L + i] = __float2half_rn(tiles[(size_t) tile_of(m) * L + i % L]);
        }
        __syncthreads();
    };

    for (int n = 0; n < units; n += 2)
    {
        load_unit(0, n);                    // slot 0's last tracebacks (T2 of unit n - 2) ran beside F2(n - 1)
        forward(0, L / 2, nullptr, pass1_keep_from<KA, KB>());   // F1(n), beside T2(n - 1)
        pass1_done(0);
        if (n + 1 < units)
        {
            load_unit(1, n + 1);            // T2(n - 1) ran beside F1(n)
            forward(1, L / 2, nullptr, pass1_keep_from<KA, KB>());   // F1(n + 1), beside T1(n)
            pass1_done(1);
            forward(0, 0, sh_bound, 0);         // F2(n), beside T1(n + 1)
            pass2_done(0, n);
            forward(1, 0, sh_bound + T, 0);     // F2(n + 1), beside T2(n)
            pass2_done(1, n + 1);
        }
        else
        {
            drain();                            // T1(n)
            forward(0, 0, sh_bound, 0);         // F2(n)
            pass2_done(0, n);
        }
    }
    drain();

    // The reconstructed values of the states the tracebacks wrote (apart from them, so that no traceback
    // position waits on a decode and a store; the barrier in drain makes the states visible to the block)
    for (int n = 0; n < count; ++n)
        for (int i = t; i < L; i += NT)
        {
            const size_t at = (size_t) tile_of(n) * L + i;
            out_values[at] = __half2float(decode_state<CB>((uint32_t) (uint16_t) out_states[at]));
        }
}

#endif  // !TRELLIS_HOST
}  // namespace trellis

#ifndef TRELLIS_HOST
namespace {

using namespace trellis;

template <int KA, int KB, int CB>
void launch(const torch::Tensor& tiles, torch::Tensor& values, torch::Tensor& states, int64_t max_blocks)
{
    constexpr int WIDE = Geometry<KA, KB>::WIDE;
    constexpr int T = Geometry<KA, KB>::T;
    // plain constants: dependent ones would make `history` a dependent type
    constexpr int64_t HBUF = (int64_t) T * Geometry<KA, KB>::HSIZE;
    const int num_tiles = (int) tiles.size(0);
    if (num_tiles == 0) return;
    const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    int blocks = std::min(num_tiles, sms);
    if (max_blocks > 0) blocks = (int) std::min<int64_t>(blocks, max_blocks);
    auto history = torch::empty({(int64_t) blocks * 2 * HBUF}, tiles.options().dtype(torch::kHalf));
    const size_t shmem = (2 * T * WIDE + 2 * T * L) * sizeof(half) + (T * NT / 32 + 2 * T) * sizeof(uint32_t) + sizeof(Trace<T>);
    auto kernel = trellis_encode_kernel<KA, KB, CB>;
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) shmem));
    kernel<<<blocks, NT, shmem, at::cuda::getCurrentCUDAStream()>>>(
        tiles.data_ptr<float>(), values.data_ptr<float>(), states.data_ptr<int16_t>(),
        reinterpret_cast<half*>(history.data_ptr<at::Half>()), num_tiles);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int KA, int KB>
void launch_cb(int64_t cb, const torch::Tensor& tiles, torch::Tensor& values, torch::Tensor& states, int64_t mb)
{
    if constexpr (KA != KB)
    {
        TORCH_CHECK(cb == 2, "trellis_encode: half rates need the mul1 codebook (2), got ", cb);
        launch<KA, KB, 2>(tiles, values, states, mb);
    }
    else
    {
        switch (cb)
        {
            case 0: launch<KA, KB, 0>(tiles, values, states, mb); break;
            case 1: launch<KA, KB, 1>(tiles, values, states, mb); break;
            case 2: launch<KA, KB, 2>(tiles, values, states, mb); break;
            default: TORCH_CHECK(false, "trellis_encode: codebook must be 0 (3INST), 1 (mcg) or 2 (mul1), got ", cb);
        }
    }
}

}  // namespace

// tiles: (N, 256) float32, contiguous, on a CUDA device; rate KA bits per step (kb = ka), or the half rate
// ka + 0.5 (kb = ka + 1). Returns (values float32 (N, 256), states int16 (N, 256)).
std::vector<torch::Tensor> encode_tiles(torch::Tensor tiles, int64_t ka, int64_t kb, int64_t cb, int64_t max_blocks)
{
    TORCH_CHECK(tiles.is_cuda() && tiles.scalar_type() == torch::kFloat && tiles.dim() == 2 && tiles.size(1) == L
                && tiles.is_contiguous(), "trellis_encode: tiles must be a contiguous CUDA float32 (N, 256) tensor");
    const c10::cuda::CUDAGuard guard(tiles.device());
    auto values = torch::empty_like(tiles);
    auto states = torch::empty(tiles.sizes(), tiles.options().dtype(torch::kShort));
    switch (ka * 10 + kb)
    {
        case 11: launch_cb<1, 1>(cb, tiles, values, states, max_blocks); break;
        case 22: launch_cb<2, 2>(cb, tiles, values, states, max_blocks); break;
        case 33: launch_cb<3, 3>(cb, tiles, values, states, max_blocks); break;
        case 44: launch_cb<4, 4>(cb, tiles, values, states, max_blocks); break;
        case 55: launch_cb<5, 5>(cb, tiles, values, states, max_blocks); break;
        case 66: launch_cb<6, 6>(cb, tiles, values, states, max_blocks); break;
        case 12: launch_cb<1, 2>(cb, tiles, values, states, max_blocks); break;
        case 23: launch_cb<2, 3>(cb, tiles, values, states, max_blocks); break;
        case 34: launch_cb<3, 4>(cb, tiles, values, states, max_blocks); break;
        default: TORCH_CHECK(false, "trellis_encode: rate (", ka, ", ", kb, ") is not K 1-6 or 1.5, 2.5, 3.5");
    }
    return {values, states};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
    m.def("encode_tiles", &encode_tiles, "Viterbi encode of 16x16 EXL3 tiles (docs/encoder.md)");
}
#endif  // !TRELLIS_HOST
