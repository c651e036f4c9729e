/* IEEE binary16 <-> binary32 conversions (round to nearest even), used by the CPU backend and the oracle. */
#include "internal.h"

#include <string.h>

float flashc_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: renormalize */
            int e = -1;
            do {
                e++;
                man <<= 1;
            } while ((man & 0x400u) == 0);
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
        }
    } else if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

uint16_t flashc_f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return sign | 0x7e00u;        /* NaN */
    if (ax >= 0x477ff000u) return sign | 0x7c00u;       /* overflow (>= 65520 rounds to inf) */
    if (ax < 0x38800000u) {                             /* subnormal or zero in f16 */
        if (ax < 0x33000000u) return sign;              /* < 2^-25 rounds to 0 */
        uint32_t man = (ax & 0x7fffffu) | 0x800000u;
        int shift = 126 - (int)(ax >> 23);              /* 14..24 */
        uint32_t half = man >> shift;
        uint32_t rem = man & ((1u << shift) - 1u);
        uint32_t mid = 1u << (shift - 1);
        if (rem > mid || (rem == mid && (half & 1u))) half++;
        return (uint16_t)(sign | half);
    }
    uint32_t r = ax + 0xfffu + ((ax >> 13) & 1u);       /* round mantissa to 10 bits */
    return (uint16_t)(sign | (uint16_t)((r - 0x38000000u) >> 13));
}
