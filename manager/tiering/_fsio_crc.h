/* CRC32C (Castagnoli) for the fs tier's block files: the SSE4.2 instruction where the CPU has
 * it (checked once at run time), else a slicing-by-8 table. Same value as google-crc32c's
 * `value()` and the `crc32c` package (initial ~0, final xor ~0): crc32c("123456789") is
 * 0xE3069283. Included by _fsio.c only. */
#ifndef KV_FSIO_CRC_H
#define KV_FSIO_CRC_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define KV_CRC32C_POLY 0x82F63B78u /* reflected */

static uint32_t kv_crc_table[8][256];
static int kv_crc_hw = -1; /* -1: not initialised; 0: table; 1: SSE4.2 */

/* The hardware path runs three streams of KV_CRC_L bytes side by side (the instruction's
 * latency is 3 cycles, its throughput 1 per cycle) and joins them: the register is linear in
 * its input, so state(A|B|C) = Z(Z(a) ^ b) ^ c, where a, b, c are the streams' registers (b and
 * c started from 0) and Z advances a register over KV_CRC_L zero bytes -- a linear map on 32
 * bits, kept as four 256-entry tables (one per byte of the register). */
#define KV_CRC_L 4096
static uint32_t kv_zl[4][256];

static uint32_t kv_zero_bytes(uint32_t c, size_t n) {
    while (n--) c = (c >> 8) ^ kv_crc_table[0][c & 0xFF];
    return c;
}

static uint32_t kv_shift(uint32_t c) {
    return kv_zl[0][c & 0xFF] ^ kv_zl[1][(c >> 8) & 0xFF] ^ kv_zl[2][(c >> 16) & 0xFF] ^ kv_zl[3][c >> 24];
}

static void kv_crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (KV_CRC32C_POLY & (0u - (c & 1u)));
        kv_crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            kv_crc_table[t][i] = (kv_crc_table[t - 1][i] >> 8) ^ kv_crc_table[0][kv_crc_table[t - 1][i] & 0xFF];
    uint32_t basis[32]; /* Z of each single-bit register, then each table entry by linearity */
    for (int j = 0; j < 32; j++) basis[j] = kv_zero_bytes(1u << j, KV_CRC_L);
    for (int k = 0; k < 4; k++)
        for (uint32_t b = 0; b < 256; b++) {
            uint32_t z = 0;
            for (int j = 0; j < 8; j++)
                if (b >> j & 1) z ^= basis[8 * k + j];
            kv_zl[k][b] = z;
        }
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    kv_crc_hw = __builtin_cpu_supports("sse4.2") ? 1 : 0;
#else
    kv_crc_hw = 0;
#endif
}

/* (state is the running register, already inverted) */
static uint32_t kv_crc_sw(uint32_t c, const unsigned char *p, size_t n) {
    while (n && ((uintptr_t)p & 7)) {
        c = (c >> 8) ^ kv_crc_table[0][(c ^ *p++) & 0xFF];
        n--;
    }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
        w = __builtin_bswap64(w);
#endif
        uint32_t lo = (uint32_t)w ^ c, hi = (uint32_t)(w >> 32);
        c = kv_crc_table[7][lo & 0xFF] ^ kv_crc_table[6][(lo >> 8) & 0xFF] ^ kv_crc_table[5][(lo >> 16) & 0xFF] ^
            kv_crc_table[4][lo >> 24] ^ kv_crc_table[3][hi & 0xFF] ^ kv_crc_table[2][(hi >> 8) & 0xFF] ^
            kv_crc_table[1][(hi >> 16) & 0xFF] ^ kv_crc_table[0][hi >> 24];
        p += 8;
        n -= 8;
    }
    while (n--) c = (c >> 8) ^ kv_crc_table[0][(c ^ *p++) & 0xFF];
    return c;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
/* Three streams while at least 3 * KV_CRC_L bytes are left (see kv_zl), then one chain. */
__attribute__((target("sse4.2"))) static uint32_t kv_crc_hw_run(uint32_t c, const unsigned char *p, size_t n) {
    uint64_t c64 = c;
    while (n && ((uintptr_t)p & 7)) {
        c64 = __builtin_ia32_crc32qi((uint32_t)c64, *p++);
        n--;
    }
    while (n >= 3 * KV_CRC_L) {
        uint64_t a = c64, b = 0, d = 0;
        for (size_t i = 0; i < KV_CRC_L; i += 8) {
            uint64_t x, y, z;
            memcpy(&x, p + i, 8);
            memcpy(&y, p + KV_CRC_L + i, 8);
            memcpy(&z, p + 2 * KV_CRC_L + i, 8);
            a = __builtin_ia32_crc32di(a, x);
            b = __builtin_ia32_crc32di(b, y);
            d = __builtin_ia32_crc32di(d, z);
        }
        c64 = kv_shift(kv_shift((uint32_t)a) ^ (uint32_t)b) ^ (uint32_t)d;
        p += 3 * KV_CRC_L;
        n -= 3 * KV_CRC_L;
    }
    while (n >= 32) {
        uint64_t a, b, d, e;
        memcpy(&a, p, 8);
        memcpy(&b, p + 8, 8);
        memcpy(&d, p + 16, 8);
        memcpy(&e, p + 24, 8);
        c64 = __builtin_ia32_crc32di(c64, a);
        c64 = __builtin_ia32_crc32di(c64, b);
        c64 = __builtin_ia32_crc32di(c64, d);
        c64 = __builtin_ia32_crc32di(c64, e);
        p += 32;
        n -= 32;
    }
    while (n >= 8) {
        uint64_t a;
        memcpy(&a, p, 8);
        c64 = __builtin_ia32_crc32di(c64, a);
        p += 8;
        n -= 8;
    }
    while (n--) c64 = __builtin_ia32_crc32qi((uint32_t)c64, *p++);
    return (uint32_t)c64;
}
#endif

/* CRC32C of p[0:n], continuing from `crc` (0 for a fresh checksum). Thread-safe once
 * kv_crc_init() ran (module init). */
static uint32_t kv_crc32c(uint32_t crc, const void *data, size_t n) {
    uint32_t c = ~crc;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (kv_crc_hw == 1) return ~kv_crc_hw_run(c, (const unsigned char *)data, n);
#endif
    return ~kv_crc_sw(c, (const unsigned char *)data, n);
}

#endif
