/* lab: d256 with 64-row tiles of 4 warps, 2 blocks per SM */
#define FC_TILE_256_SM90 fc_tile{256, 64, 32, 4, 2, 0, 2}
