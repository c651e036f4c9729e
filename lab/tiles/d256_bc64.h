/* lab: d256 with 64-key tiles (203 KB of shared memory: Hopper only; adopted for Hopper in v4) */
#define FC_TILE_256_SM90 fc_tile{256, 128, 64, 8, 2, 0, 1}
