/* lab: the Hopper forward's d 128 tile with 64-key tiles in 4 stages (the same ring bytes as 128 keys in 2): more,
 * smaller loads in flight for decode, where the key stream is the whole cost */
#define FC90_TILE_128 fc90_tile{128, 128, 64, 4}
