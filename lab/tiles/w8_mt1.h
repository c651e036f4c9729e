/* lab: 8 warps of one m16 tile each, Q in registers (d64 and d128) */
#define FC_TILE_64_SM90 fc_tile{64, 128, 64, 8, 2, 1, 2}
#define FC_TILE_128_SM90 fc_tile{128, 128, 64, 8, 2, 1, 1}
