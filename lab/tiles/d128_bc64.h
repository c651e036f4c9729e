/* lab: d128 with 64-key tiles, 2 stages (2 blocks per SM), possible once tile addresses are rebuilt per tile;
 * adopted for Hopper in v6 */
#define FC_TILE_128_SM90 fc_tile{128, 128, 64, 4, 2, 0, 2}
