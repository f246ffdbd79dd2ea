//! Choosing a burn device by name, so programs switch backends with a flag, not a rebuild of code.

use std::str::FromStr;

use burn::tensor::Device;

use crate::error::CoreError;

/// A compute backend that eesd can run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// burn's pure-Rust CPU backend (cargo feature `flex`, the default).
    Flex,
    /// LibTorch on the CPU (cargo feature `tch`).
    Tch,
    /// LibTorch on CUDA device 0 (cargo feature `tch`).
    TchCuda,
    /// burn's CUDA backend on device 0 (cargo feature `cuda`).
    Cuda,
    /// burn's wgpu backend pinned to Vulkan, on the GPU wgpu ranks best (cargo feature
    /// `vulkan`; `CUBECL_WGPU_DEFAULT_DEVICE` overrides the choice).
    Vulkan,
}

impl Backend {
    /// All backends, in the order they are listed to users.
    pub const ALL: [Backend; 5] = [
        Backend::Flex,
        Backend::Tch,
        Backend::TchCuda,
        Backend::Cuda,
        Backend::Vulkan,
    ];

    /// The name used on command lines.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Flex => "flex",
            Backend::Tch => "tch",
            Backend::TchCuda => "tch-cuda",
            Backend::Cuda => "cuda",
            Backend::Vulkan => "vulkan",
        }
    }

    /// The first backend compiled into this build, preferring the CPU default `flex`.
    pub fn default_compiled() -> Option<Backend> {
        Backend::ALL.into_iter().find(|b| b.device().is_ok())
    }

    /// The device of this backend, or an error naming the cargo feature that enables it.
    #[allow(deprecated, unreachable_code)] // burn marks its LibTorch constructors deprecated
    pub fn device(self) -> Result<Device, CoreError> {
        let missing = |feature: &str| CoreError::Backend {
            name: self.name().into(),
            reason: format!("this build lacks the cargo feature `{feature}`"),
        };
        match self {
            Backend::Flex => {
                #[cfg(feature = "flex")]
                return Ok(Device::flex());
                Err(missing("flex"))
            }
            Backend::Tch => {
                #[cfg(feature = "tch")]
                return Ok(Device::libtorch());
                Err(missing("tch"))
            }
            Backend::TchCuda => {
                #[cfg(feature = "tch")]
                return libtorch_cuda();
                Err(missing("tch"))
            }
            Backend::Cuda => {
                #[cfg(feature = "cuda")]
                return Ok(Device::cuda(0));
                Err(missing("cuda"))
            }
            Backend::Vulkan => {
                #[cfg(feature = "vulkan")]
                return vulkan();
                Err(missing("vulkan"))
            }
        }
    }
}

/// LibTorch's CUDA device 0, checked by placing one value on it. burn-tch decides at build time
/// whether CUDA can be used: built against a CPU-only LibTorch (such as
/// `scripts/setup-libtorch.sh`'s), it panics at the first tensor on a CUDA device even where a
/// CUDA LibTorch is loaded at run time; LibTorch itself fails where no GPU is visible. Both
/// become an error here instead of a panic in the middle of a program.
#[cfg(feature = "tch")]
fn libtorch_cuda() -> Result<Device, CoreError> {
    // burn 0.22 marks its LibTorch devices deprecated in favour of CubeCL ones; the LibTorch
    // backend stays here while burn ships it (and CUDA through it is what builds for users
    // whose machines cannot fetch cubecl's LLVM).
    #[allow(deprecated)]
    let device = Device::libtorch_cuda(0);
    let probe = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        burn::tensor::Tensor::<1>::zeros([1], &device).into_data()
    }));
    match probe {
        Ok(_) => Ok(device),
        Err(payload) => {
            let message = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "LibTorch failed on CUDA device 0".into());
            Err(CoreError::Backend {
                name: Backend::TchCuda.name().into(),
                reason: format!("{message} (build against a CUDA LibTorch, see docs/backends.md)"),
            })
        }
    }
}

/// burn's Vulkan device, once the Vulkan loader has shown at least one device. burn's wgpu
/// runtime looks for one only at the first tensor, on a thread of its own, and panics there when
/// there is none (no Vulkan loader, no driver for the GPU, a headless machine): `--device vulkan`
/// would abort the program. Asked here the same way (an instance limited to Vulkan, its
/// adapters), the answer is kept for the process: the loader dislikes instances coming and going
/// while the runtime creates its own.
#[cfg(feature = "vulkan")]
fn vulkan() -> Result<Device, CoreError> {
    use burn::backend::wgpu::wgpu;
    use std::task::{Context, Poll, Waker};
    static ADAPTERS: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    let adapters = *ADAPTERS.get_or_init(|| {
        let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
            backends: wgpu::Backends::VULKAN,
            ..wgpu::InstanceDescriptor::new_without_display_handle()
        });
        // Native wgpu enumerates at once: its future is ready at the first poll.
        let mut listing = std::pin::pin!(instance.enumerate_adapters(wgpu::Backends::VULKAN));
        match listing
            .as_mut()
            .poll(&mut Context::from_waker(Waker::noop()))
        {
            Poll::Ready(adapters) => Some(adapters.len()),
            Poll::Pending => None,
        }
    });
    match adapters {
        Some(0) => Err(CoreError::Backend {
            name: Backend::Vulkan.name().into(),
            reason: "the Vulkan loader finds no device (install the GPU's Vulkan driver and \
                     `libvulkan1`; `VK_DRIVER_FILES` names a driver's ICD file, see \
                     docs/backends.md)"
                .into(),
        }),
        // Some devices, or a listing that was not ready: the runtime picks one.
        _ => Ok(Device::vulkan(burn::tensor::DeviceKind::DefaultDevice)),
    }
}

impl FromStr for Backend {
    type Err = CoreError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Backend::ALL
            .into_iter()
            .find(|b| b.name() == s)
            .ok_or_else(|| CoreError::Backend {
                name: s.into(),
                reason: "unknown backend (expected flex, tch, tch-cuda, cuda or vulkan)".into(),
            })
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// With a CPU-only LibTorch (CI's), `tch-cuda` is an error, not a panic at the first tensor.
    #[cfg(feature = "tch")]
    #[test]
    fn tch_cuda_without_a_cuda_libtorch_is_an_error() {
        let result = Backend::TchCuda.device();
        let cuda_libtorch = std::env::var("LIBTORCH").is_ok_and(|dir| {
            std::path::Path::new(&dir)
                .join("lib/libtorch_cuda.so")
                .exists()
        });
        if !cuda_libtorch {
            let err = result.expect_err("a CPU-only LibTorch cannot give a CUDA device");
            assert!(err.to_string().contains("tch-cuda"), "{err}");
        }
    }

    /// Without a Vulkan device (CI's machines), `vulkan` is an error, not a panic on the
    /// runtime's thread at the first tensor; with one, a tensor goes there and back.
    #[cfg(feature = "vulkan")]
    #[test]
    fn vulkan_without_a_device_is_an_error() {
        match Backend::Vulkan.device() {
            Ok(device) => {
                let data = burn::tensor::Tensor::<1>::from_floats([1.0, 2.0], &device).into_data();
                assert_eq!(data.try_to_vec::<f32>().unwrap(), vec![1.0, 2.0]);
            }
            Err(err) => assert!(err.to_string().contains("finds no device"), "{err}"),
        }
    }

    #[test]
    fn parses_names() {
        for b in Backend::ALL {
            assert_eq!(b.name().parse::<Backend>().unwrap(), b);
        }
        assert!("metal".parse::<Backend>().is_err());
    }

    #[test]
    fn default_build_has_a_backend() {
        assert!(Backend::default_compiled().is_some());
    }
}
