//! [`eesd_core::CausalModel`] for [`Llama`]: the bridge from the decoding loop to the network.

use eesd_core::CausalModel;

use crate::cache::KvCache;
use crate::error::{ModelError, Result};
use crate::llama::Llama;

impl CausalModel for Llama {
    type Cache = KvCache;
    type Error = ModelError;

    fn new_cache(&self) -> KvCache {
        Llama::new_cache(self)
    }

    fn context_length(&self) -> usize {
        self.config().context_length
    }

    fn forward_last(&self, tokens: &[u32], cache: &mut KvCache) -> Result<Vec<f32>> {
        let logits = Llama::forward_last(self, tokens, cache)?;
        logits
            .into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .map_err(|e| ModelError::TensorData(format!("{e:?}")))
    }
}
