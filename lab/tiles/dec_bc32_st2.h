/* decode tile: 2 stages of 32 keys (37 KB at d 128: six blocks, six warps per SM instead of three) */
#define FC_TILE_DEC(d) fc_tile{d, 16, 32, 1, 2, d <= 128 ? 1 : 0, 1}
