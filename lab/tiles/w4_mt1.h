/* lab: 64-row tiles, 4 warps of one m16 tile each, Q in registers, 3 (d64) / 2 (d128) blocks per SM */
#define FC_TILE_64_SM90 fc_tile{64, 64, 64, 4, 2, 1, 3}
#define FC_TILE_128_SM90 fc_tile{128, 64, 64, 4, 2, 1, 2}
