//! Feed positions as a database shows them: CouchDB 3's form `N-opaque`, where `N` counts
//! roughly how far the feed is, and clients treat the whole as opaque. The backend's own
//! position token is the part after the first `-`; `N` is its leading digits (the embedded
//! store's position is a number, so its `N` is exact; other backends' tokens start with a time).
//! PouchDB's checkpointer and its tests read `N` from such a sequence.

/// The backend's position `token` as a database shows it.
pub fn show(token: &str) -> String {
    let digits: String = token.chars().take_while(char::is_ascii_digit).collect();
    let n = if digits.is_empty() { "0" } else { digits.as_str() };
    format!("{n}-{token}")
}

/// The backend's position inside a sequence a client sends back: the part after `N-` when the
/// text has that form, else the text itself (`0`, `now`, and tokens of earlier releases).
pub fn read(text: &str) -> &str {
    match text.split_once('-') {
        Some((n, token)) if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) => token,
        _ => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shown_positions_read_back_to_the_token() {
        for token in ["1", "42", "1795686448525g~179568645352900000008fe5bcfe8", "abc", "7-x"] {
            assert_eq!(read(&show(token)), token, "{token}");
        }
        assert_eq!(show("12"), "12-12");
        assert!(show("abc").starts_with("0-"));
        assert_eq!(read("0"), "0");
        assert_eq!(read("now"), "now");
    }
}
