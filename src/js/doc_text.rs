//! [`DocText`]: a document as a map function is handed it, kept as the JSON text the realm
//! parses, with the parsed value made only when Rust code asks for it.
//!
//! A view build hands every document to the realm as text (`mapDoc(docJson)`); a document read
//! from its stored text goes there without ever being a `Value` (issue 38: parsing each body,
//! copying it into the document and writing that again was a fifth of a build). Mappers written
//! in Rust (Mango's JSON indexes, test doubles) read [`DocText::value`], parsed once on first use.

use std::sync::OnceLock;

use serde_json::Value;

/// A document's JSON text (an object), and its value once asked for.
#[derive(Debug, Clone)]
pub struct DocText {
    text: Box<str>,
    parsed: OnceLock<Value>,
}

impl DocText {
    /// A document already written as JSON text by this crate (a JSON object, compact). The
    /// text is trusted, not checked: [`DocText::value`] reads text that does not parse as
    /// `null`.
    pub fn from_json_text(text: String) -> Self {
        DocText { text: text.into_boxed_str(), parsed: OnceLock::new() }
    }

    /// The text of `value`, the value kept as it is.
    pub fn from_value(value: Value) -> Self {
        let parsed = OnceLock::new();
        let text = value.to_string().into_boxed_str();
        let _ = parsed.set(value);
        DocText { text, parsed }
    }

    /// The JSON text, as the realm receives it.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The document as a value, parsed from the text on first use (at any depth the text has:
    /// it is this crate's own writing of a stored document).
    pub fn value(&self) -> &Value {
        self.parsed.get_or_init(|| crate::model::depth::parse_stored(self.text.as_bytes()).unwrap_or(Value::Null))
    }
}

impl From<Value> for DocText {
    fn from(value: Value) -> Self {
        DocText::from_value(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn text_and_value_agree_either_way_it_is_made() {
        let doc = json!({"_id": "a", "n": 1.50, "s": "é\n"});
        let from_value = DocText::from_value(doc.clone());
        let from_text = DocText::from_json_text(doc.to_string());
        assert_eq!(from_value.text(), from_text.text());
        assert_eq!(from_text.value(), &doc);
        assert_eq!(from_value.value(), &doc);
    }
}
