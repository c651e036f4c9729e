/* decode tile: 3 stages of 32 keys (55 KB at d 128: four blocks per SM, two tiles in flight each) */
#define FC_TILE_DEC(d) fc_tile{d, 16, 32, 1, 3, d <= 128 ? 1 : 0, 1}
