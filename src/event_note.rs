//! An Event's note as the API server takes it: at most 1,024 bytes (`NoteLengthLimit` in its validation). Notes that
//! list what an event is about (claims, devices, pods) can outgrow it on a big node, and the API server refuses the
//! whole Event for it; cut here instead, on a character boundary, ending in an ellipsis.

/// The longest note the API server takes, in bytes.
pub const NOTE_LIMIT: usize = 1024;

/// `note`, cut to [`NOTE_LIMIT`] bytes when longer.
pub fn fit(mut note: String) -> String {
    if note.len() > NOTE_LIMIT {
        note.truncate(note.floor_char_boundary(NOTE_LIMIT - '…'.len_utf8()));
        note.push('…');
    }
    note
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notes_are_cut_to_the_api_limit_on_a_character_boundary() {
        assert_eq!(fit("short".into()), "short");
        let exact = "x".repeat(NOTE_LIMIT);
        assert_eq!(fit(exact.clone()), exact);
        let cut = fit("é".repeat(600));
        assert!(cut.len() <= NOTE_LIMIT && cut.ends_with('…'), "{} bytes", cut.len());
        assert!(cut.trim_end_matches('…').chars().all(|c| c == 'é'), "cut inside a character");
    }
}
