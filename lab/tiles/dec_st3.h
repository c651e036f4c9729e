/* decode tile: 3 stages of 64 keys (108 KB at d 128: two blocks per SM) */
#define FC_TILE_DEC(d) fc_tile{d, 16, d <= 128 ? 64 : 32, 1, 3, d <= 128 ? 1 : 0, 1}
