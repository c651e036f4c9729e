/* lab: d256 with Q in registers */
#define FC_TILE_256_SM90 fc_tile{256, 128, 32, 8, 2, 1, 1}
