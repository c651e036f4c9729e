/* decode tile: 4 stages of 32 keys (74 KB at d 128, as the default's 2 x 64: three blocks per SM) */
#define FC_TILE_DEC(d) fc_tile{d, 16, 32, 1, 4, d <= 128 ? 1 : 0, 1}
