/* lab: the Hopper forward's d 128 tile with 3 stages of 128 keys (the output staged over Q and K, one tile per
 * block): two tiles' loads in flight while the consumers work on a third, for decode, where the key stream is the
 * whole cost and 2 stages leave one 64 KB load in flight per SM */
#define FC90_TILE_128 fc90_tile{128, 128, 128, 3}
