/* lab: 3 cp.async stages for d64 and d128 (adopted for Hopper in v4) */
#define FC_TILE_64_SM90 fc_tile{64, 128, 64, 4, 3, 1, 2}
#define FC_TILE_128_SM90 fc_tile{128, 128, 32, 4, 3, 0, 2}
