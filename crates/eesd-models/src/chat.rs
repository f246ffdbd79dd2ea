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

/// Template instructions allowed for a render: a fixed allowance plus some per message (the
/// SmolLM template spends about 40 per message), so a template that loops stops with an error.
const FUEL_BASE: u64 = 100_000;
const FUEL_PER_MESSAGE: u64 = 10_000;
/// Output allowed for a render: the messages' own text several times over plus a fixed
/// allowance, so a template cannot produce unbounded text.
const OUTPUT_BASE: usize = 1 << 20;
const OUTPUT_PER_INPUT_BYTE: usize = 4;

/// A writer that refuses bytes past its limit.
struct Bounded {
    text: Vec<u8>,
    limit: usize,
}

impl std::io::Write for Bounded {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.text.len() + buf.len() > self.limit {
            return Err(std::io::Error::other(format!(
                "output over {} bytes",
                self.limit
            )));
        }
        self.text.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

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
        t.environment(FUEL_BASE)?;
        Ok(t)
    }

    fn environment(&self, fuel: u64) -> Result<minijinja::Environment<'_>> {
        let mut env = minijinja::Environment::new();
        env.set_fuel(Some(fuel));
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
    /// answer begins. A template that runs too long or writes too much (bounds grow with the
    /// conversation) is stopped with [`ModelError::ChatTemplate`].
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let fuel = FUEL_BASE + FUEL_PER_MESSAGE * messages.len() as u64;
        let env = self.environment(fuel)?;
        let template = env
            .get_template(NAME)
            .map_err(|e| ModelError::ChatTemplate(e.to_string()))?;
        let input: usize = messages
            .iter()
            .map(|m| m.role.len() + m.content.len())
            .sum::<usize>()
            + self.bos_token.len()
            + self.eos_token.len();
        let mut out = Bounded {
            text: Vec::new(),
            limit: OUTPUT_BASE.saturating_add(input.saturating_mul(OUTPUT_PER_INPUT_BYTE)),
        };
        template
            .render_captured_to(
                minijinja::context! {
                    messages => messages,
                    add_generation_prompt => add_generation_prompt,
                    bos_token => &self.bos_token,
                    eos_token => &self.eos_token,
                },
                &mut out,
            )
            .map_err(|e| ModelError::ChatTemplate(e.to_string()))?;
        String::from_utf8(out.text).map_err(|e| ModelError::ChatTemplate(e.to_string()))
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

    #[test]
    fn templates_that_loop_or_flood_are_stopped() {
        let endless =
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}";
        let flood = "{% for i in range(100000) %}{{ bos_token * 100 }}{% endfor %}";
        let recursive = "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}";
        for source in [endless, flood, recursive] {
            let t = ChatTemplate::new(source, "<s>", "").unwrap();
            assert!(
                matches!(
                    t.render(&[ChatMessage::user("x")], true),
                    Err(ModelError::ChatTemplate(_))
                ),
                "{source}"
            );
        }
    }
}
