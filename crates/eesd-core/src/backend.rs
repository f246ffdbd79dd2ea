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
                return cuda();
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

/// Whether burn's runtime of `kind` finds a device on this machine, asked once per process.
/// burn's CubeCL runtimes look for their device only at the first tensor, on a thread of their
/// own, and panic there when there is none (no driver, no GPU, a headless machine): the program
/// would abort. burn's own listing (`Device::enumerate`) asks the driver without opening a
/// device and answers "none" where the driver library is missing; the answer is kept because
/// drivers dislike instances coming and going while the runtime creates its own.
#[cfg(any(feature = "vulkan", feature = "cuda"))]
fn has_device(kind: burn::tensor::DeviceType, found: &'static std::sync::OnceLock<bool>) -> bool {
    *found.get_or_init(|| !Device::enumerate(kind).is_empty())
}

/// burn's Vulkan device, once the Vulkan loader has shown at least one device ([`has_device`]).
#[cfg(feature = "vulkan")]
fn vulkan() -> Result<Device, CoreError> {
    static FOUND: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if has_device(burn::tensor::DeviceType::Vulkan, &FOUND) {
        return Ok(Device::vulkan(burn::tensor::DeviceKind::DefaultDevice));
    }
    Err(CoreError::Backend {
        name: Backend::Vulkan.name().into(),
        reason: "the Vulkan loader finds no device (install the GPU's Vulkan driver and \
                 `libvulkan1`; `VK_DRIVER_FILES` names a driver's ICD file, see \
                 docs/backends.md)"
            .into(),
    })
}

/// burn's CUDA device 0, once the CUDA driver has shown at least one device ([`has_device`]).
#[cfg(feature = "cuda")]
fn cuda() -> Result<Device, CoreError> {
    static FOUND: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if has_device(burn::tensor::DeviceType::Cuda, &FOUND) {
        return Ok(Device::cuda(0));
    }
    Err(CoreError::Backend {
        name: Backend::Cuda.name().into(),
        reason: "the CUDA driver finds no device (`libcuda` missing or no NVIDIA GPU visible; \
                 see docs/backends.md)"
            .into(),
    })
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

    /// A GPU backend's device round-trips a tensor, or, without a device, is an error (not a
    /// panic on the runtime's thread at the first tensor).
    #[cfg(any(feature = "vulkan", feature = "cuda"))]
    fn device_or_error(backend: Backend) {
        match backend.device() {
            Ok(device) => {
                let data = burn::tensor::Tensor::<1>::from_floats([1.0, 2.0], &device).into_data();
                assert_eq!(data.try_to_vec::<f32>().unwrap(), vec![1.0, 2.0]);
            }
            Err(err) => {
                let text = err.to_string();
                assert!(text.contains(backend.name()), "{text}");
                assert!(text.contains("finds no device"), "{text}");
            }
        }
    }

    /// CI's machines have no Vulkan device.
    #[cfg(feature = "vulkan")]
    #[test]
    fn vulkan_without_a_device_is_an_error() {
        device_or_error(Backend::Vulkan);
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn cuda_without_a_device_is_an_error() {
        device_or_error(Backend::Cuda);
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
