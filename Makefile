# flashc: the two set-up commands are `make run` and `make test`.
BUILD ?= build
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
CMAKE_FLAGS ?=

.PHONY: all build run test test-gpu asan install clean

all: build

$(BUILD)/CMakeCache.txt:
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)

build: $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j $(JOBS)

# Builds, then benchmarks the default backend (CUDA when a GPU is there, else CPU).
run: build
	$(BUILD)/flashc bench

# Builds, then runs every test that this machine can run (GPU tests: `make test-gpu`).
test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) -LE gpu

test-gpu: build
	cd $(BUILD) && ctest --output-on-failure -L gpu

# The CPU test suite under AddressSanitizer and UBSan.
asan:
	cmake -S . -B $(BUILD)-asan -DCMAKE_BUILD_TYPE=Debug -DFLASHC_SANITIZE=ON -DFLASHC_CUDA=off
	cmake --build $(BUILD)-asan -j $(JOBS)
	cd $(BUILD)-asan && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
	  ctest --output-on-failure -j $(JOBS) -LE "gpu|python"

install: build
	cmake --install $(BUILD) $(if $(PREFIX),--prefix $(PREFIX),)

clean:
	rm -rf $(BUILD) $(BUILD)-asan
