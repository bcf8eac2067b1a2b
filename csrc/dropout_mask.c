/* nn.Dropout's mask (§5.4 of "Attention Is All You Need"), drawn from PyTorch's CPU generator without
 * PyTorch: the same numbers, in about a seventh of the time.
 *
 * PyTorch's CPU bernoulli_(q) (its default kernel) takes one 64-bit draw x per element from the
 * generator's 32-bit Mersenne Twister (MT19937: x = first word << 32 | second word) and keeps the
 * element when its low 53 bits are below ceil(q * 2^53); nn.Dropout then divides the mask by q.
 * PyTorch draws the words one at a time; here the generator's 624-word state is regenerated and
 * tempered a whole block at a time, loops a compiler turns into vector instructions, and the scaled
 * mask is written directly. The Python side (the_annotated_transformer.mask_drawer) checks
 * once per probability and dtype that this reproduces bernoulli_ exactly, mask and generator state,
 * and uses PyTorch's own draws wherever it does not.
 *
 * Build: make build/dropout_mask.so (cc -O3 -shared -fPIC). Integer arithmetic only, so every
 * instruction set gives the same bits; with GCC on x86-64 the hot loop is compiled three times
 * (AVX-512, AVX2, baseline) and the loader picks the one the CPU runs.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

enum { N = 624, M = 397 }; /* MT19937's state length and shift (Matsumoto & Nishimura, 1998) */

/* Where PyTorch's torch.get_rng_state() keeps the Mersenne Twister (CPUGeneratorImplStateLegacy):
 * int32 `left` (words until the next regeneration, plus one) at byte 8, uint64 `next` (index of the
 * next word) at byte 16, the 624 state words as uint64 from byte 24; 5056 bytes in all. */
enum { LEFT_AT = 8, NEXT_AT = 16, WORDS_AT = 24, STATE_BYTES = 5056 };

static inline uint32_t twist(uint32_t u, uint32_t v) {
    uint32_t mixed = (u & 0x80000000u) | (v & 0x7fffffffu);
    return (mixed >> 1) ^ ((v & 1u) ? 0x9908b0dfu : 0u);
}

/* The next 624 state words from the last 624, as PyTorch's mt19937 next_state() computes them. */
static inline void regenerate(uint32_t *restrict s) {
    int i;
    for (i = 0; i < N - M; i++) s[i] = s[i + M] ^ twist(s[i], s[i + 1]);
    for (; i < N - 1; i++) s[i] = s[i + M - N] ^ twist(s[i], s[i + 1]);
    s[N - 1] = s[M - 1] ^ twist(s[N - 1], s[0]);
}

static inline uint32_t temper(uint32_t y) {
    y ^= y >> 11;
    y ^= (y << 7) & 0x9d2c5680u;
    y ^= (y << 15) & 0xefc60000u;
    return y ^ (y >> 18);
}

/* The next n output words of the generator (s, *left, *next) into w, advancing it as PyTorch's
 * engine does one word at a time: when `left` would drop to zero it regenerates, restarts at word 0
 * and counts 624 down again. */
static inline void words(uint32_t *restrict s, int32_t *left, int32_t *next, uint32_t *restrict w, size_t n) {
    while (n) {
        if (*left == 1) {
            regenerate(s);
            *left = N + 1;
            *next = 0;
        }
        size_t take = (size_t)(*left - 1) < n ? (size_t)(*left - 1) : n;
        const uint32_t *src = s + *next;
        for (size_t j = 0; j < take; j++) w[j] = temper(src[j]);
        w += take;
        n -= take;
        *next += (int32_t)take;
        *left -= (int32_t)take;
    }
}

/* GCC 12 or later on x86-64 with glibc: one version of the function per instruction set, picked when the
 * library loads (an ifunc); older GCCs do not know these names, musl has no ifuncs, other compilers
 * build one plain version. */
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12 && defined(__x86_64__) && defined(__GLIBC__)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

enum { CHUNK = 1024 }; /* elements per block of words: 8 KiB of draws, kept in the L1 cache */

/* out[i] = `kept` where element i's draw keeps it, else 0, for n elements of 2 or 4 bytes (the
 * bit patterns of 1/q and of +0.0 in the tensor's dtype). Returns 0, or -1 (nothing changed) for a
 * state that is not one PyTorch's generator could be in or an element size other than 2 or 4. */
CLONES int dropout_mask(uint8_t *state, uint64_t threshold, uint32_t kept, void *out, int64_t n, int element_size) {
    int32_t left, next32;
    uint64_t next, wide[N];
    uint32_t s[N], w[2 * CHUNK];
    memcpy(&left, state + LEFT_AT, sizeof left);
    memcpy(&next, state + NEXT_AT, sizeof next);
    if (n < 0 || (element_size != 2 && element_size != 4) || left < 1 || left > N || next > N ||
        next + (uint64_t)left - 1 > N)
        return -1;
    memcpy(wide, state + WORDS_AT, sizeof wide);
    for (int i = 0; i < N; i++) s[i] = (uint32_t)wide[i];
    next32 = (int32_t)next;
    const uint64_t low53 = (UINT64_C(1) << 53) - 1;
    for (int64_t done = 0; done < n; done += CHUNK) {
        size_t k = (size_t)(n - done < CHUNK ? n - done : CHUNK);
        words(s, &left, &next32, w, 2 * k);
        if (element_size == 4) {
            uint32_t *o = (uint32_t *)out + done;
            for (size_t j = 0; j < k; j++) o[j] = ((((uint64_t)w[2 * j] << 32) | w[2 * j + 1]) & low53) < threshold ? kept : 0u;
        } else {
            uint16_t *o = (uint16_t *)out + done;
            for (size_t j = 0; j < k; j++)
                o[j] = ((((uint64_t)w[2 * j] << 32) | w[2 * j + 1]) & low53) < threshold ? (uint16_t)kept : (uint16_t)0;
        }
    }
    for (int i = 0; i < N; i++) wide[i] = s[i];
    memcpy(state + WORDS_AT, wide, sizeof wide);
    memcpy(state + LEFT_AT, &left, sizeof left);
    next = (uint64_t)next32;
    memcpy(state + NEXT_AT, &next, sizeof next);
    return 0;
}

/* What the caller checks before its first call: this file's interface (the arguments of dropout_mask; bump
 * it when they change, so that an old build is refused rather than called wrongly) and the size of the
 * generator state it reads and writes. */
int dropout_mask_interface(void) { return 1; }
int dropout_mask_state_bytes(void) { return STATE_BYTES; }
