/*
 * flashc's autograd function in C++ (flashc.cpp_autograd): the forward and backward of a planned flash_attn_func,
 * flashc.attention or flashc.scaled_dot_product_attention call (flashc.ops' per-shape plans: (B, N, H, D) tensors, or
 * SDPA's (B, H, N, D) with bhnd, scalar options only) without Python in either direction. On CUDA, autograd runs a
 * backward on its device thread; a Python backward there must take the GIL from the calling thread, a C++ one does
 * not. The workspace sizes come from the plan, which asked the library once.
 *
 * Built on first use against the running torch (flashc/cpp_autograd.py), it links against no flashc library: the
 * package hands it the addresses of the loaded library's functions (init), and the flashc_params of a call as the
 * bytes of the package's ctypes struct. The library calls, their arguments and so their results are the Python
 * path's: out, lse and the gradients bit for bit (python/tests/test_cpp_autograd.py).
 */
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>

namespace {

/* flashc.h's types, as far as this file uses them (the params are opaque bytes of the package's struct). */
struct fc_tensor {
    void *data;
    int dtype;
    int64_t shape[4];
    int64_t stride[4];
};
enum { FC_OK = 0, FC_BACKEND_CPU = 1, FC_BACKEND_CUDA = 2, FC_F32 = 0, FC_F16 = 1, FC_BF16 = 2 };
typedef void *fc_ctx;

/* The library's functions, from init(). */
struct fc_api {
    int (*context_create)(fc_ctx *, int, int);
    int (*context_set_stream)(fc_ctx, void *);
    int (*context_set_threads)(fc_ctx, int);
    const char *(*context_last_error)(fc_ctx);
    const char *(*status_string)(int);
    int (*forward)(fc_ctx, const fc_tensor *, const fc_tensor *, const fc_tensor *, const void *, const fc_tensor *,
                   float *, void *, size_t);
    int (*backward)(fc_ctx, const fc_tensor *, const fc_tensor *, const fc_tensor *, const fc_tensor *,
                    const fc_tensor *, const float *, const void *, const fc_tensor *, const fc_tensor *,
                    const fc_tensor *, void *, size_t);
};
fc_api api;
bool ready = false;

int dtype_of(const at::Tensor &t) {
    switch (t.scalar_type()) {
    case at::kFloat: return FC_F32;
    case at::kHalf: return FC_F16;
    case at::kBFloat16: return FC_BF16;
    default: throw std::invalid_argument("flashc: float32, float16 or bfloat16 tensors");
    }
}

/* The library's (B, N, H, D) view of a caller's tensor: as it is, or SDPA's (B, H, N, D) with bhnd (dims 1 and 2
 * swapped, no tensor made). */
fc_tensor view(const at::Tensor &t, bool bhnd) {
    fc_tensor v;
    v.data = t.data_ptr();
    v.dtype = dtype_of(t);
    const int dims[4] = {0, bhnd ? 2 : 1, bhnd ? 1 : 2, 3};
    for (int i = 0; i < 4; i++) v.shape[i] = t.size(dims[i]), v.stride[i] = t.stride(dims[i]);
    return v;
}

/* torch.empty_like of the (B, N, H, D) view, in the caller's layout (the full path's gradients): for a dense tensor
 * that is empty_like of the tensor itself, whose strides it keeps. */
at::Tensor empty_like4(const at::Tensor &t, bool bhnd) {
    if (!bhnd || t.is_non_overlapping_and_dense()) return at::empty_like(t);
    return at::empty_like(t.transpose(1, 2)).transpose(1, 2);
}

/* This thread's context for the tensors' device (flashc contexts are not shared by threads that call at once), set
 * to the call's thread count (CPU) or torch's current stream (CUDA). */
fc_ctx context(const at::Tensor &t, int64_t threads) {
    thread_local std::map<std::pair<int, int>, fc_ctx> contexts;
    const bool cuda = t.is_cuda();
    const std::pair<int, int> key(cuda ? FC_BACKEND_CUDA : FC_BACKEND_CPU, cuda ? t.get_device() : 0);
    fc_ctx &ctx = contexts[key];
    if (!ctx) {
        fc_ctx made = nullptr;
        const int st = api.context_create(&made, key.first, key.second);
        if (st != FC_OK) throw std::runtime_error(std::string("flashc: context: ") + api.status_string(st));
        ctx = made;
    }
    if (cuda) {
        const c10::Stream s = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(t.device());
        api.context_set_stream(ctx, s.native_handle());
    } else {
        api.context_set_threads(ctx, (int)threads);
    }
    return ctx;
}

void check(int st, fc_ctx ctx, const char *what) {
    if (st != FC_OK)
        throw std::runtime_error(std::string(what) + ": " + api.status_string(st) + ": " + api.context_last_error(ctx));
}

/* The call's workspace (the plan's size: 0 on the CPU, which allocates its own) from torch's allocator. */
at::Tensor workspace(const at::Tensor &like, int64_t bytes) {
    return bytes ? at::empty({bytes}, like.options().dtype(at::kByte)) : at::Tensor();
}

/* Tensors as flashc's Python path (_torch.apply, _torch.sdpa) makes them: out contiguous in (B, N, H, D), the
 * gradients by empty_like of the (B, N, H, D) views, each handed back in the caller's layout. */
struct Attention : public torch::autograd::Function<Attention> {
    static torch::autograd::variable_list forward(torch::autograd::AutogradContext *actx, const at::Tensor &q,
                                                  const at::Tensor &k, const at::Tensor &v, std::string params,
                                                  int64_t threads, bool want_lse, bool bhnd, int64_t fwd_ws,
                                                  int64_t bwd_ws) {
        c10::OptionalDeviceGuard guard(q.device());
        fc_ctx ctx = context(q, threads);
        const fc_tensor vq = view(q, bhnd), vk = view(k, bhnd), vv = view(v, bhnd);
        const int64_t B = vq.shape[0], N = vq.shape[1], H = vq.shape[2], D = vq.shape[3];
        const at::Tensor out = bhnd ? at::empty({B, N, H, D}, q.options()).transpose(1, 2) : at::empty(q.sizes(),
                                                                                                       q.options());
        at::Tensor lse = at::empty({B, H, N}, q.options().dtype(at::kFloat));
        const fc_tensor vo = view(out, bhnd);
        const at::Tensor ws = workspace(q, fwd_ws);
        check(api.forward(ctx, &vq, &vk, &vv, params.data(), &vo, lse.data_ptr<float>(),
                          fwd_ws ? ws.data_ptr() : nullptr, (size_t)fwd_ws),
              ctx, "flashc_forward");
        actx->save_for_backward({q, k, v, out, lse});
        actx->saved_data["params"] = std::move(params);
        actx->saved_data["threads"] = threads;
        actx->saved_data["bhnd"] = bhnd;
        actx->saved_data["bwd_ws"] = bwd_ws;
        actx->mark_non_differentiable({lse});
        actx->set_materialize_grads(false);
        if (!want_lse) return {out};
        return {out, lse};
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext *actx,
                                                   torch::autograd::variable_list grads) {
        const auto s = actx->get_saved_variables();
        const at::Tensor &q = s[0], &k = s[1], &v = s[2], &out = s[3], &lse = s[4];
        const std::string params = actx->saved_data["params"].toStringRef();
        const bool bhnd = actx->saved_data["bhnd"].toBool();
        c10::OptionalDeviceGuard guard(q.device());
        fc_ctx ctx = context(q, actx->saved_data["threads"].toInt());
        at::Tensor dout = grads[0].defined() ? grads[0] : at::zeros_like(out);
        if (dout.scalar_type() != out.scalar_type()) dout = dout.to(out.scalar_type());
        const at::Tensor dq = empty_like4(q, bhnd), dk = empty_like4(k, bhnd), dv = empty_like4(v, bhnd);
        const fc_tensor vq = view(q, bhnd), vk = view(k, bhnd), vv = view(v, bhnd), vo = view(out, bhnd),
                        vd = view(dout, bhnd), vdq = view(dq, bhnd), vdk = view(dk, bhnd), vdv = view(dv, bhnd);
        const int64_t bwd_ws = actx->saved_data["bwd_ws"].toInt();
        const at::Tensor ws = workspace(q, bwd_ws);
        check(api.backward(ctx, &vq, &vk, &vv, &vo, &vd, lse.data_ptr<float>(), params.data(), &vdq, &vdk, &vdv,
                           bwd_ws ? ws.data_ptr() : nullptr, (size_t)bwd_ws),
              ctx, "flashc_backward");
        return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    }
};

void init(const std::map<std::string, uintptr_t> &fns) {
    auto get = [&](const char *name) {
        const auto it = fns.find(name);
        if (it == fns.end() || !it->second) throw std::invalid_argument(std::string("flashc: no address for ") + name);
        return (void *)it->second;
    };
    fc_api a;
    a.context_create = (decltype(a.context_create))get("flashc_context_create");
    a.context_set_stream = (decltype(a.context_set_stream))get("flashc_context_set_stream");
    a.context_set_threads = (decltype(a.context_set_threads))get("flashc_context_set_threads");
    a.context_last_error = (decltype(a.context_last_error))get("flashc_context_last_error");
    a.status_string = (decltype(a.status_string))get("flashc_status_string");
    a.forward = (decltype(a.forward))get("flashc_forward");
    a.backward = (decltype(a.backward))get("flashc_backward");
    api = a;
    ready = true;
}

py::object attention(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, py::bytes params, int64_t threads,
                     bool want_lse, bool bhnd, int64_t fwd_ws, int64_t bwd_ws) {
    if (!ready) throw std::runtime_error("flashc: cpp_autograd used before init");
    auto r = Attention::apply(q, k, v, std::string(params), threads, want_lse, bhnd, fwd_ws, bwd_ws);
    if (!want_lse) return py::cast(r[0]);
    return py::make_tuple(r[0], r[1]);
}

} // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("init", &init, "the loaded flashc library's function addresses, by name");
    m.def("attention", &attention, "out (or (out, lse)) of a planned call, with autograd through C++",
          py::arg("q"), py::arg("k"), py::arg("v"), py::arg("params"), py::arg("threads"), py::arg("want_lse"),
          py::arg("bhnd"), py::arg("fwd_ws"), py::arg("bwd_ws"));
}
