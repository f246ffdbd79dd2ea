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
                return Ok(Device::libtorch_cuda(0));
                Err(missing("tch"))
            }
            Backend::Cuda => {
                #[cfg(feature = "cuda")]
                return Ok(Device::cuda(0));
                Err(missing("cuda"))
            }
            Backend::Vulkan => {
                #[cfg(feature = "vulkan")]
                return Ok(Device::vulkan(burn::tensor::DeviceKind::DefaultDevice));
                Err(missing("vulkan"))
            }
        }
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
