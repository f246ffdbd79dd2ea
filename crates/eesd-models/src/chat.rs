//! Chat templates (Jinja, as shipped with the model) rendered with `minijinja`.

use serde::Serialize;

use crate::error::{ModelError, Result};

/// One chat turn.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The text of the turn.
    pub content: String,
}

impl ChatMessage {
    /// A user turn.
    pub fn user(content: impl Into<String>) -> Self {
        ChatMessage {
            role: "user".into(),
            content: content.into(),
        }
    }

    /// A system turn.
    pub fn system(content: impl Into<String>) -> Self {
        ChatMessage {
            role: "system".into(),
            content: content.into(),
        }
    }

    /// An assistant turn.
    pub fn assistant(content: impl Into<String>) -> Self {
        ChatMessage {
            role: "assistant".into(),
            content: content.into(),
        }
    }
}

/// A model's chat template.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    source: String,
    bos_token: String,
    eos_token: String,
}

const NAME: &str = "chat";

impl ChatTemplate {
    /// Parses a Jinja template; `bos_token`/`eos_token` are the strings the template may reference.
    pub fn new(
        source: impl Into<String>,
        bos_token: impl Into<String>,
        eos_token: impl Into<String>,
    ) -> Result<Self> {
        let t = ChatTemplate {
            source: source.into(),
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
        };
        t.environment()?;
        Ok(t)
    }

    fn environment(&self) -> Result<minijinja::Environment<'_>> {
        let mut env = minijinja::Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_template(NAME, &self.source)
            .map_err(|e| ModelError::ChatTemplate(e.to_string()))?;
        Ok(env)
    }

    /// The template source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders a conversation; with `add_generation_prompt` the text ends where the assistant's
    /// answer begins.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let env = self.environment()?;
        let template = env
            .get_template(NAME)
            .map_err(|e| ModelError::ChatTemplate(e.to_string()))?;
        template
            .render(minijinja::context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
            })
            .map_err(|e| ModelError::ChatTemplate(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMOL: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

    #[test]
    fn renders_chatml_with_default_system_prompt() {
        let t = ChatTemplate::new(SMOL, "<|im_start|>", "<|im_end|>").unwrap();
        let text = t.render(&[ChatMessage::user("Hi")], true).unwrap();
        assert_eq!(
            text,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn bad_templates_are_errors() {
        assert!(matches!(
            ChatTemplate::new("{% for %}", "", ""),
            Err(ModelError::ChatTemplate(_))
        ));
        let t = ChatTemplate::new("{{ raise_exception('no') }}", "", "").unwrap();
        assert!(t.render(&[], false).is_err());
    }
}
